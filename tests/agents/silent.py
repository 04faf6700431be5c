"""A scripted agent that exits cleanly without writing a candidate."""
print("nothing to propose")
