"""A whole training step compiled (``compile_step``) beside the same step eager, for unmodified ``transformers``
models in every layout ``examples/train.py`` has, on 4 CPU ranks; each run checked against one process.

    .venv/bin/python -m benchmarks.compile_steps [--quick] [--steps 10]

Models: the zoo's Qwen2 and Mixtral (``examples/train.py --model qwen2 | mixtral``), and a tiny Llama and GPT-2
built here from their configurations and saved to a temporary folder (``--model DIR``; Llama takes the zoo's
Qwen2 tensor-parallel plan, whose module names it shares; GPT-2 ``examples/train.py``'s own).
Layouts: ``dp``, ``sharded``, ``tp`` (Mixtral: experts split by expert, the rest tensor parallel) and ``2d``.

Each (model, layout) runs eagerly (``--eager``), then as one program (``compile_step``, backend ``eager``: the
traced program run op by op, no Inductor), as separate ``torchrun`` launches of ``examples/train.py``; each launch
trains the same model on the same batches, then trains it again in one process and reports the largest relative
difference of the losses. The step time is rank 0's, per step from ``--metrics``, the first two steps left out
(the compiled step's first runs eagerly and its second traces); median and quartiles.

Writes ``docs/benchmarks/compile_steps.{json,md,png}``."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks import harness
from zoo import dense

LAYOUTS = ["dp", "sharded", "tp", "2d"]
MODELS = ["qwen2", "mixtral", "llama", "gpt2"]
MODES = {"eager": ["--eager"], "compile_step": []}


def _saved_models(folder: str) -> dict[str, str]:
    """Tiny Llama and GPT-2 (random weights, dropout off) saved into ``folder``: name -> its model folder."""
    import transformers as tf

    torch.manual_seed(0)
    configs = {
        "llama": dense.llama_config(max_position_embeddings=64),
        "gpt2": tf.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        ),
    }
    saved = {}
    for name, config in configs.items():
        path = os.path.join(folder, name)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        saved[name] = path
    return saved


def _run(model: str, layout: str, mode: str, steps: int, folder: str) -> dict:
    metrics = os.path.join(folder, f"{os.path.basename(model)}-{layout}-{mode}.jsonl")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        *(os.path.join(harness.REPO, "examples", "train.py"), "--model", model, "--layout", layout),
        *("--steps", str(steps), "--metrics", metrics, "--check", "on", *MODES[mode]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=harness.REPO, timeout=900)
    found = re.search(r"largest relative difference over \d+ steps is ([0-9.e+-]+)", done.stdout)
    row = {"returncode": done.returncode, "loss_rel_diff": float(found.group(1)) if found else None}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return row
    with open(metrics) as f:
        seconds = [json.loads(line)["step_s"] for line in f][2:]
    row["step"] = harness.summary([s * 1e6 for s in seconds])
    return row


def report(rows: list[dict]) -> str:
    table = []
    for r in rows:
        eager, compiled = r["eager"], r["compile_step"]
        diff = [x.get("loss_rel_diff") for x in (eager, compiled)]
        table.append(
            [
                r["model"],
                harness.LAYOUT_NAMES.get(r["layout"], r["layout"]),
                harness.fmt(eager.get("step"), "ms") if "step" in eager else eager.get("error", "—"),
                harness.fmt(compiled.get("step"), "ms") if "step" in compiled else compiled.get("error", "—"),
                harness.ratio(eager.get("step"), compiled.get("step")),
                ", ".join("—" if d is None else f"{d:.1e}" for d in diff),
            ]
        )
    header = ["model", "layout", "eager step", "compile_step", "speed-up", "loss rel. diff (eager, compiled)"]
    return "\n".join(
        [
            f"Machine: {harness.machine()}. Code measured: {harness.code_state()}.",
            "",
            "![compile_steps](compile_steps.png)",
            "",
            "Step time on 4 CPU ranks sharing the machine's cores, rank 0's, median (quartiles) of the steps after the "
            "first two; speed-up = eager median / compile_step median. Loss rel. diff: the largest relative "
            "difference of each run's losses from the same training in one process. Written by "
            "`benchmarks/compile_steps.py`.",
            "",
            harness.markdown_table(header, table),
            "",
            harness.load_note(rows),
        ]
    )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['layout']}" for r in rows]
    for offset, mode in ((-0.2, "eager"), (0.2, "compile_step")):
        stats = [r[mode].get("step") for r in rows]
        med = [s["median_us"] / 1e3 if s else 0 for s in stats]
        err = [
            [(s["median_us"] - s["q1_us"]) / 1e3 if s else 0 for s in stats],
            [(s["q3_us"] - s["median_us"]) / 1e3 if s else 0 for s in stats],
        ]
        ax.bar([i + offset for i in range(len(rows))], med, 0.4, yerr=err, capsize=2, label=mode)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("step (ms), median and quartiles")
    ax.set_title("Eager vs compile_step, 4 CPU ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the zoo's Qwen2 in DP only")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", nargs="+", choices=MODELS, help="measure these again; keep the others' rows")
    args = parser.parse_args()
    models = ["qwen2"] if args.quick else args.models or MODELS
    rows = []
    if args.models:
        with open(os.path.join(harness.DOCS, "compile_steps.json")) as f:
            rows = [row for row in json.load(f) if row["model"] not in models]
    with tempfile.TemporaryDirectory() as folder:
        saved = {} if args.quick else _saved_models(folder)
        for name in models:
            for layout in ["dp"] if args.quick else LAYOUTS:
                row = {"model": name, "layout": layout}
                for mode in MODES:
                    row[mode] = _run(saved.get(name, name), layout, mode, args.steps, folder)
                row["load"] = os.getloadavg()[0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: (MODELS.index(r["model"]), LAYOUTS.index(r["layout"])))
    with open(os.path.join(harness.DOCS, "compile_steps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(harness.DOCS, "compile_steps.md"), "w") as f:
        title = "# Compiled steps beside eager ones"
        f.write(
            f"{title}\n\n<!-- generated by `python -m benchmarks.compile_steps`; do not edit -->\n\n{report(rows)}\n"
        )
    plot(rows, os.path.join(harness.DOCS, "compile_steps.png"))


if __name__ == "__main__":
    main()
