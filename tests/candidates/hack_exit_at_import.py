"""Guard 1 hack (runner level, the static check would refuse the import of os): the process
exits at import without answering."""
import os

os._exit(3)
