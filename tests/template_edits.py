"""A built-in template changed the way a wrong kernel would be, then run through the trusted
harness on the CPU: what the template tests' rejection cases share."""
from __future__ import annotations


def evaluate_edited(kernel: str, template, old: str, new: str, tmp_path, *, name: str, params: dict,
                    shape: dict):
    """The harness's verdict on `template` with its one occurrence of `old` replaced by `new`
    (written to tmp_path/hack_<name>.py), checked fresh at `shape` with `params`, not timed."""
    from kernelsearch.harness import evaluate

    text = template.read_text()
    assert text.count(old) == 1, f"{name}: the text to change is not in {template.name} exactly once"
    path = tmp_path / f"hack_{name}.py"
    path.write_text(text.replace(old, new))
    return evaluate(kernel, path, params=params, device="cpu", time_it=False, fresh=True, shapes=[shape])
