"""Markdown + PNG report of a bench run, optionally against a recorded baseline."""
from __future__ import annotations

from pathlib import Path


def _rows(doc: dict) -> dict:
    """(kind, variant, batch, length) -> row, for ok rows."""
    out = {}
    for r in doc.get("decode", []):
        if r.get("status") == "ok":
            out[("decode", r["variant"], r["batch"], r["ctx"])] = r
    for r in doc.get("prefill", []):
        if r.get("status") == "ok":
            out[("prefill", r["variant"], r["batch"], r["tokens"])] = r
    w = doc.get("workload")
    if w and w.get("metric") is not None:
        # Keyed by the command: two different workloads' metrics are not one row to divide.
        out[("workload", str(w.get("command") or "command"), 0, 0)] = {"tokens_per_s": w["metric"],
                                                                        "tokens_per_j": None}
    return out


def flatten(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list) and d and all(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = d
    return out


# Fingerprint fields that change from run to run without meaning a different environment.
_NOISY = ("temperature_c", "sm_clock_mhz", "memory_clock_mhz", "clock_event_reasons", "host",
          "hardware_status")


def fingerprint_diff(a: dict, b: dict) -> list[tuple[str, object, object]]:
    fa, fb = flatten(a or {}), flatten(b or {})
    keys = sorted(set(fa) | set(fb))
    return [(k, fa.get(k), fb.get(k)) for k in keys
            if fa.get(k) != fb.get(k) and not any(n in k.split(".")[-1] or k.startswith(n) for n in _NOISY)]


def _gpu_name(doc) -> str | None:
    fp = doc.get("fingerprint") or {}
    return ((fp.get("gpu") or {}).get("name") or (fp.get("software") or {}).get("gpu_name_torch")
            or ("cpu" if doc.get("label") == "cpu" else None))


def _virt(doc) -> bool | None:
    return ((doc.get("fingerprint") or {}).get("virtualization") or {}).get("virtualized")


def notes(doc: dict, base: dict | None) -> list[str]:
    out = [doc.get("fair_note", "")] if doc.get("fair_note") else []
    if doc.get("label") == "cpu":
        out.append("This run is on CPU (tiny model): it proves the pipeline, not GPU performance.")
        if any(interpreted(doc, r) for r in doc.get("decode", []) + doc.get("prefill", [])):
            out.append("Rows marked 'interpreter timing' ran Triton kernels under the interpreter "
                       "(Python, program by program): they show the kernels run and agree with eager; "
                       "they are not speeds, and slower than eager is expected there.")
    if base is None:
        return out
    if _virt(doc) and _virt(base):
        out.append("Both runs are virtualized: this compares one VM with another, not bare metal "
                   "with a VM.")
    elif _virt(base) and _virt(doc) is False:
        out.append("Bare metal (this run) against a virtualized baseline.")
    ga, gb = _gpu_name(doc), _gpu_name(base)
    if ga != gb:
        out.append(f"The GPUs differ ({ga} vs {gb}): ratios reflect the hardware as much as the tuning.")
    if (doc.get("model") or {}).get("name") != (base.get("model") or {}).get("name"):
        out.append("The models differ: ratios compare different workloads.")
    if doc.get("dtype") != base.get("dtype"):
        out.append(f"The dtypes differ ({doc.get('dtype')} vs {base.get('dtype')}): ratios compare "
                   "different workloads.")
    return out


def comparison_text(doc: dict, base: dict) -> str:
    """The baseline comparison for the terminal: the report's ratios, one line a row both runs
    measured (what differs between the runs is said on stderr)."""
    rows, brows = _rows(doc), _rows(base)
    lines = [f"against baseline {base.get('label')} ({(base.get('model') or {}).get('name')}, "
             f"{base.get('created') or 'undated'}): tokens/s and tokens/J, this run / baseline"]
    shared = sorted(set(rows) & set(brows), key=lambda k: (k[0], k[2], k[3], k[1]))
    for key in shared:
        r, b = rows[key], brows[key]
        rs = r["tokens_per_s"] / b["tokens_per_s"] if r.get("tokens_per_s") and b.get("tokens_per_s") else None
        rj = r["tokens_per_j"] / b["tokens_per_j"] if r.get("tokens_per_j") and b.get("tokens_per_j") else None
        where = f" B={key[2]} {'ctx' if key[0] == 'decode' else 'tokens'}={key[3]}" if key[0] != "workload" else ""
        lines.append(f"  {key[0]} {_variant_label(doc, r, key[1])}{where}: "
                     f"{_fmt(r.get('tokens_per_s'), '.0f')} vs {_fmt(b.get('tokens_per_s'), '.0f')} tokens/s "
                     f"({_fmt(rs, '.2f')}x), tokens/J {_fmt(rj, '.2f')}x")
    if not shared:
        lines.append("  no row was measured in both runs (other variants, batches or lengths): nothing to divide")
    return "\n".join(lines)


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def interpreted(doc: dict, row: dict) -> bool:
    """A CPU row that ran Triton kernels: under the interpreter, so a timing, not a speed."""
    return doc.get("label") == "cpu" and (bool(row.get("interpreter_timing")) or any(
        not str(impl).startswith("stock") for impl in (row.get("kernels") or {}).values()))


def _variant_label(doc: dict, row: dict, variant: str) -> str:
    return f"{variant} (interpreter timing, not a speed)" if interpreted(doc, row) else variant


def markdown(doc: dict, base: dict | None = None, png_name: str | None = "report.png") -> str:
    rows, brows = _rows(doc), _rows(base or {})
    lines = ["# hwtune bench report", ""]
    model = doc.get("model") or {}
    lines.append(f"Run: {doc.get('label')} — model {model.get('name')} ({doc.get('dtype')}), "
                 f"copy bandwidth {_fmt(doc.get('copy_bandwidth_gbs'), '.0f')} GB/s.")
    if base is not None:
        lines.append(f"Baseline: {base.get('label')} — model {(base.get('model') or {}).get('name')}.")
    lines.append("")
    for n in notes(doc, base):
        lines.append(f"- {n}")
    lines += ["", "## Throughput", ""]
    head = "| kind | variant | batch | ctx/tokens | ms | tokens/s | tokens/J | % of floor |"
    sep = "|---|---|---:|---:|---:|---:|---:|---:|"
    if base is not None:
        head += " baseline tokens/s | baseline tokens/J | ratio tokens/s | ratio tokens/J |"
        sep += "---:|---:|---:|---:|"
    lines += [head, sep]
    for key in sorted(set(rows) | set(brows), key=lambda k: (k[0], k[2], k[3], k[1])):
        r, b = rows.get(key, {}), brows.get(key, {})
        ms = r.get("step_ms", r.get("time_ms"))
        variant = _variant_label(doc, r, key[1])
        line = (f"| {key[0]} | {variant} | {key[2] or '-'} | {key[3] or '-'} | {_fmt(ms, '.3f')} | "
                f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('tokens_per_j'))} | "
                f"{_fmt(r.get('pct_of_floor', r.get('pct_of_floor_with_head')), '.0f')} |")
        if base is not None:
            rs = (r["tokens_per_s"] / b["tokens_per_s"]) if r.get("tokens_per_s") and b.get("tokens_per_s") else None
            rj = (r["tokens_per_j"] / b["tokens_per_j"]) if r.get("tokens_per_j") and b.get("tokens_per_j") else None
            line += (f" {_fmt(b.get('tokens_per_s'), '.0f')} | {_fmt(b.get('tokens_per_j'))} | "
                     f"{_fmt(rs, '.2f')} | {_fmt(rj, '.2f')} |")
        lines.append(line)
    failed = [r for r in doc.get("decode", []) + doc.get("prefill", []) if r.get("status") != "ok"]
    if failed:
        lines += ["", "Not measured:", ""]
        for r in failed:
            lines.append(f"- {r['variant']} {r['batch']}x{r.get('ctx', r.get('tokens'))}: {r.get('status')}")
    warned = [r for r in doc.get("decode", []) if r.get("status") == "ok" and r.get("warning")]
    if warned:
        lines += ["", "Measured, with a warning:", ""]
        lines += [f"- {r['variant']} {r['batch']}x{r['ctx']}: {r['warning']}" for r in warned]
    floors = [f for f in doc.get("floors", []) if f.get("floor_ms")]
    if floors:
        lines += ["", "## Decode bandwidth floor", "",
                  "(layer weight bytes + KV read for the context + KV written) / measured copy "
                  "bandwidth; without and with the final norm + LM head", "",
                  "| batch | ctx | GB moved (no head) | floor ms (no head) | floor ms (with head) |",
                  "|---:|---:|---:|---:|---:|"]
        for f in floors:
            gb = f.get("total_bytes_no_head", f["total_bytes"]) / 1e9
            with_head = f.get("floor_with_head_ms")
            lines.append(f"| {f['batch']} | {f['ctx']} | {gb:.3f} | {f['floor_ms']:.3f} | "
                         f"{format(with_head, '.3f') if with_head else '-'} |")
    table = doc.get("kernel_table") or {}
    if table.get("note"):
        lines += ["", "## Dispatch table of the tuned variant", "", table["note"]]
    if table.get("search"):
        lines += ["", "Searched before measuring (kernelsearch's search: its keep rule, its timer):", "",
                  "| kernel | shape | dtype | result |", "|---|---|---|---|"]
        for d in table["search"]:
            shape = " ".join(f"{k}={v}" for k, v in (d.get("shape") or {}).items())
            lines.append(f"| {d.get('kernel')} | {shape} | {d.get('dtype')} | {d.get('result')} |")
    lines += hf_markdown(doc)
    per_layer = [r for r in doc.get("decode", []) if r.get("model") != "hf-llama" and r.get("kernels_per_layer")]
    if per_layer:
        lines += ["", "## Kernel launches per decoder layer", "",
                  "Counted from what runs (a tuned entry: its verified plan's launches; stock: torch's "
                  "usual CUDA launches); fused: where a fused decode kernel replaced unfused calls.", "",
                  "| variant | batch | ctx | kernels/layer | stock kernels/layer | fused |",
                  "|---|---:|---:|---:|---:|---|"]
        for r in per_layer:
            stock = (r.get("kernels_per_layer_stock") or r["kernels_per_layer"]).get("total")
            fused = [f"{p}: {w.removeprefix('fused: ')}" for p, w in (r.get("fusions") or {}).items()
                     if w.startswith("fused")]
            lines.append(f"| {r['variant']} | {r['batch']} | {r['ctx']} | {r['kernels_per_layer'].get('total')} | "
                         f"{stock} | {', '.join(fused) or '-'} |")
    if doc.get("tuned_kernels"):
        lines += ["", "## Kernels the tuned variant used", ""]
        for shape, used in doc["tuned_kernels"].items():
            parts = [f"{op}: {u.get('impl')}" + (f" ({u['reason']})" if u.get("reason") else "")
                     for op, u in used.items()]
            lines.append(f"- {shape}: " + "; ".join(parts))
    for run in (doc.get("compile") or {}).get("runs", []):
        lines.append(f"- torch.compile: {run.get('compile_s', 0):.0f}s to compile, CUDA graphs "
                     f"{run.get('cudagraphs')}" + (f": {run['messages'][0]}" if run.get("messages") else ""))
    if doc.get("workload"):
        w = doc["workload"]
        lines += ["", "## Workload", "", f"`{w.get('command')}` -> metric {w.get('metric')} "
                  f"({w.get('status')}; line: `{w.get('metric_line')}`)"]
    if base is not None:
        diff = fingerprint_diff(doc.get("fingerprint"), base.get("fingerprint"))
        lines += ["", "## Environment differences", "", "| field | this run | baseline |", "|---|---|---|"]
        for k, a, b in diff[:80]:
            lines.append(f"| {k} | {str(a)[:60]} | {str(b)[:60]} |")
        if not diff:
            lines.append("| (none) | | |")
    if png_name:
        lines += ["", f"![throughput]({png_name})"]
    return "\n".join(lines) + "\n"


def hf_markdown(doc: dict) -> list[str]:
    """The hf-llama rows' own table: errors against hf eager, speedup against hf compiled, and
    what each patch changed."""
    hf = doc.get("hf")
    if not hf:
        return []
    m = hf.get("model") or {}
    lines = ["", "## Hugging Face LlamaForCausalLM (--model hf-llama)", "",
             f"{m.get('name')}: {m.get('source')}, {hf.get('dtype')}, transformers {hf.get('transformers')}, "
             f"torch {hf.get('torch')}; StaticCache of ctx positions; errors: max |diff| / max |ref| "
             f"against hf eager (decode: {hf.get('check')} teacher-forced steps); % of floor: the full "
             "step (logits out) against weights + KV bytes over the copy bandwidth.", ""]
    if hf.get("note"):
        lines += [f"- {hf['note']}", ""]
    lines += ["| variant | batch | ctx | ms/step | tokens/s | tokens/J | % of floor | vs hf compiled | "
              "prefill err | decode err | same token | status |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc.get("decode", []):
        if r.get("model") != "hf-llama":
            continue
        same = r.get("same_token_share")
        lines.append(f"| {r.get('label', r['variant'])} | {r['batch']} | {r['ctx']} | {_fmt(r.get('step_ms'), '.3f')} | "
                     f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('tokens_per_j')) if r.get('tokens_per_j') else 'n/a'} | "
                     f"{_fmt(r.get('pct_of_floor_with_head'), '.0f')} | {_fmt(r.get('speedup_vs_hf_compiled'), '.2f')} | "
                     f"{_fmt(r.get('prefill_err_vs_hf_eager'), '.1e')} | {_fmt(r.get('decode_err_vs_hf_eager'), '.1e')} | "
                     f"{format(same, '.0%') if same is not None else '-'} | {str(r.get('status'))[:120]} |")
    if hf.get("kernel_table"):
        lines += ["", f"hwtune kernels: {hf['kernel_table'].get('note')}"]
        for d in hf["kernel_table"].get("search") or []:
            shape = " ".join(f"{k}={v}" for k, v in (d.get("shape") or {}).items())
            lines.append(f"- searched {d.get('kernel')} {shape} {d.get('dtype')}: {d.get('result')}")
    for r in doc.get("decode", []):
        if r.get("model") == "hf-llama" and r.get("patch_report"):
            lines += ["", f"{r.get('label', r['variant'])} {r['batch']}x{r['ctx']}:", ""]
            lines += [f"    {line}" for line in r["patch_report"]]
    return lines


def plot(doc: dict, base: dict | None, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(doc, base)
    path = Path(path)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


def figure(doc: dict, base: dict | None):
    """The tokens/s bar chart as a matplotlib figure (the caller saves and closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, brows = _rows(doc), _rows(base or {})
    keys = sorted(set(rows) | set(brows), key=lambda k: (k[0], k[2], k[3], k[1]))
    labels = [f"{k[0][:3]} {k[1]}" + ("\n(interpreter)" if interpreted(doc, rows.get(k, {})) else "")
              + f"\n{k[2]}x{k[3]}" if k[0] != "workload" else "workload" for k in keys]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(keys) + 2), 4.5))
    x = list(range(len(keys)))
    width = 0.4 if base is not None else 0.8
    ax.bar([i - (width / 2 if base is not None else 0) for i in x],
           [rows.get(k, {}).get("tokens_per_s") or 0 for k in keys], width, label="this run")
    if base is not None:
        ax.bar([i + width / 2 for i in x], [brows.get(k, {}).get("tokens_per_s") or 0 for k in keys],
               width, label="baseline")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    values = [v for k in keys for v in (rows.get(k, {}).get("tokens_per_s"), brows.get(k, {}).get("tokens_per_s")) if v]
    # Bars start at zero, so that a difference looks as big as it is; only when values span
    # more than 20x (a CPU's interpreter next to eager) the axis goes log, and says so.
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (log scale)")
    else:
        ax.set_ylim(bottom=0)
        ax.set_ylabel("tokens/s")
    ax.set_title(f"hwtune bench: {(doc.get('model') or {}).get('name')} ({doc.get('label')})"
                 + (": a pipeline check, not speeds" if doc.get("label") == "cpu" else ""))
    ax.legend()
    fig.tight_layout()
    return fig


def write_report(doc: dict, base: dict | None, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(doc, base, "report.png"))
    png = plot(doc, base, out_dir / "report.png")
    return {"markdown": str(md), "png": str(png)}
