#!/usr/bin/env python
"""`make bench`: internlm-core against the peers of ../shared/bench/peers, side by side, one invocation.

Runs, one after the other (never two at once: the machine has 2 cores),
1. the peers' `peak_flops.py` (fp32 and bf16 matmul peaks: the MFU denominators),
2. for each mode (fp32 eager, bf16, compiled bf16, compiled fp32): the HF Trainer, the HF model in a plain loop
   (fp32 only), the bare PyTorch loop (their scripts, unmodified; other modes through bench/peer_modes.py),
   and internlm-core (`train.py --config configs/bench_cpu.py`, bench/internlm.py),
3. the real-document comparison (bench/real_data.py) unless --skip-real,
then prints one table with the ratios internlm-core / bare loop and internlm-core / HF Trainer (and compiled /
eager of internlm-core), and warns when something else loaded the machine during a timed window.
Then the other benchmarks of bench/ (tokenizer, loader, checkpoint) run with their own tables (--skip-extras).

    python bench/run.py [--out bench/results/<stamp>] [--modes fp32,bf16,bf16_compile,compile] [--repeat N]
    python bench/run.py --table bench/results/<stamp>      # print the table of an earlier run again

Results: <out>/<mode>/r<k>/<peer>.json (the peers' format) and <out>/table.txt. With --repeat N every
(mode, system) runs N times, round robin, and the table shows for each the run with the median tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import internlm as ours  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", ROOT.parent / "shared" / "bench" / "peers"))
ALL_MODES = ("fp32", "bf16", "bf16_compile", "compile")
MODE_TITLES = {"fp32": "fp32 eager", "bf16": "bf16 (autocast / ours)", "bf16_compile": "bf16 + torch.compile",
               "compile": "fp32 + torch.compile"}
SYSTEMS = {  # mode -> systems in run order
    "fp32": ("hf_trainer", "hf_loop", "bare_loop", "internlm_core"),
    "bf16": ("hf_trainer", "bare_loop", "internlm_core"),
    "bf16_compile": ("hf_trainer", "bare_loop", "internlm_core"),
    "compile": ("hf_trainer", "bare_loop", "internlm_core"),
}
TARGETS = {  # (mode, numerator, denominator-system or "eager:<mode>") -> minimum ratio
    ("fp32", "bare_loop"): 0.97,
    ("bf16", "bare_loop"): 1.15,
    ("bf16_compile", "eager:bf16"): 1.10,
    ("compile", "eager:fp32"): 1.10,
}
LOAD_WARN = 0.05
EXTRAS = ("bench_tokenizer.py", "bench_loader.py", "bench_checkpoint.py")  # the other benchmarks of bench/
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def log(msg: str) -> None:
    print(msg, flush=True)


def steal_s() -> tuple[float, float]:
    """(wall s, CPU-s the hypervisor stole from this VM, /proc/stat's steal column)."""
    f = open("/proc/stat").readline().split()
    return time.perf_counter(), int(f[8]) / os.sysconf("SC_CLK_TCK")


def run_peer(system: str, mode: str, out: Path) -> dict:
    """Run one system in one mode; also records the hypervisor's steal time over the whole run."""
    out.mkdir(parents=True, exist_ok=True)
    a = steal_s()
    try:
        return _run_peer(system, mode, out)
    finally:
        b = steal_s()
        (out / f"{system}.steal").write_text(f"{(b[1] - a[1]) / (b[0] - a[0]):.4f}\n")


def _run_peer(system: str, mode: str, out: Path) -> dict:
    if system == "internlm_core":
        return ours.run(mode, out)
    if system == "hw_peak":
        with open(out / "hw_peak.log", "w") as fh:
            rc = subprocess.call([sys.executable, str(HERE / "hw_peak.py"), str(out)], stdout=fh,
                                 stderr=subprocess.STDOUT, env=ENV)
        if rc != 0:
            raise RuntimeError(f"hw_peak.py failed ({rc}): {(out / 'hw_peak.log').read_text()[-2000:]}")
        return json.loads((out / "hw_peak.json").read_text())
    if mode == "fp32" or system == "peak_flops":
        cmd = [sys.executable, str(PEERS_DIR / f"{system}.py"), str(out)]
    else:
        cmd = [sys.executable, str(HERE / "peer_modes.py"), str(PEERS_DIR), system, mode, str(out)]
    with open(out / f"{system}.log", "w") as fh:
        rc = subprocess.call(cmd, cwd=PEERS_DIR, stdout=fh, stderr=subprocess.STDOUT, env=ENV)
    text = (out / f"{system}.log").read_text().splitlines()
    if rc != 0:
        raise RuntimeError(f"{system} ({mode}) failed with exit code {rc}:\n" + "\n".join(text[-30:]))
    log(f"  {text[-1] if text else ''}")
    return json.loads((out / f"{system}.json").read_text())


def load_results(out: Path) -> tuple[dict, dict]:
    """(peak, {mode: {system: [results of each repeat]}})."""
    peak = json.loads((out / "peak_flops.json").read_text())
    hw = out / "hw_peak.json"
    peak["hw"] = json.loads(hw.read_text()) if hw.exists() else {}
    res: dict = {}
    for mode in ALL_MODES:
        for rdir in sorted((out / mode).glob("r*")) if (out / mode).is_dir() else []:
            for f in sorted(rdir.glob("*.json")):
                r = json.loads(f.read_text())
                st = f.with_suffix(".steal")
                r["steal"] = float(st.read_text()) if st.exists() else None
                res.setdefault(mode, {}).setdefault(r["peer"], []).append(r)
    return peak, res


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one for an even count)."""
    s = sorted(runs, key=lambda r: r["tok_s_median"])
    return s[(len(s) - 1) // 2]


def table(out: Path) -> str:
    peak, res = load_results(out)
    p32 = peak["peak_fp32_gflops"]
    p16 = max([v for k, v in peak.items() if k.startswith("bf16_")] or [float("nan")])
    hw = peak["hw"]
    h32, h16 = max(p32, hw.get("peak_fp32_gflops", 0.0)), max(p16, hw.get("peak_bf16_gflops", 0.0))
    lines = [f"peak matmul (peers' peak_flops.py, torch.matmul, {peak['threads']} threads): fp32 {p32:.0f} GFLOP/s, "
             f"bf16 {p16:.0f} GFLOP/s; other load during it {peak['other_load']:.2f} cores"]
    if hw.get("peak_fp32_gflops"):
        lines.append(f"peak matmul on oneDNN (bench/hw_peak.py, the same products): fp32 {hw['peak_fp32_gflops']:.0f} "
                     f"GFLOP/s, bf16 {hw.get('peak_bf16_gflops', 0.0):.0f} GFLOP/s -- 'MFU' uses the peers' peak, "
                     f"'MFU hw' the higher of the two (fp32 {h32:.0f}, bf16 {h16:.0f})")
    any_run = next(r for m in res.values() for rs in m.values() for r in rs)
    lines.append("other load: cores something else in this VM kept busy during the timed steps (the peers' measure); "
                 "steal: cores the hypervisor took from this VM during the whole run")
    lines.append(f"model: {any_run['n_params']:,} params, {any_run['flops_per_token'] / 1e6:.2f} MFLOP/token, "
                 f"{any_run['tokens_per_step']} tokens/step, timed steps {any_run['timed_steps']}; "
                 f"MFU against the peak of the mode's dtype")
    reps = max(len(rs) for m in res.values() for rs in m.values())
    if reps > 1:
        lines.append(f"{reps} repeats per row: the run with the median tok/s is shown, 'spread' = (max-min)/median")
    lines.append("")
    head = f"{'mode':<22} {'system':<14} {'tok/s med':>9} {'tok/s mean':>10} {'step ms':>8} {'RSS MB':>7} " \
           f"{'MFU':>6} {'MFU hw':>6} {'final loss':>10} {'other load':>10} {'steal':>5}" + (f" {'spread':>6}" if reps > 1 else "")
    lines += [head, "-" * len(head)]
    best: dict = {}
    loads = [peak["other_load"]]
    for mode in ALL_MODES:
        if mode not in res:
            continue
        pk = p16 if mode.startswith("bf16") else p32
        hk = h16 if mode.startswith("bf16") else h32
        for system in SYSTEMS[mode]:
            runs = res[mode].get(system)
            if not runs:
                continue
            r = median_run(runs)
            best[(mode, system)] = r
            loads += [x["other_load"] for x in runs if x.get("other_load") is not None]
            mfu = r["tok_s_median"] * r["flops_per_token"] / (pk * 1e9)
            mfu_hw = r["tok_s_median"] * r["flops_per_token"] / (hk * 1e9)
            ol = "n/a" if r.get("other_load") is None else f"{r['other_load']:.2f}"
            stl = "n/a" if r.get("steal") is None else f"{r['steal']:.2f}"
            row = f"{MODE_TITLES[mode]:<22} {system:<14} {r['tok_s_median']:9.0f} {r['tok_s_mean']:10.0f} " \
                  f"{r['step_ms_median']:8.1f} {r['peak_rss_mb']:7.0f} {mfu:6.1%} {mfu_hw:6.1%} {r['final_loss']:10.3f} {ol:>10} {stl:>5}"
            if reps > 1:
                v = [x["tok_s_median"] for x in runs]
                row += f" {(max(v) - min(v)) / statistics.median(v):6.1%}"
            lines.append(row)
    lines += ["", "ratios (tokens/s, median step)                      ratio   target"]

    def ratio_line(label: str, a: dict | None, b: dict | None, target: float | None) -> None:
        if a is None or b is None:
            return
        q = a["tok_s_median"] / b["tok_s_median"]
        verdict = "" if target is None else f">= {target:.2f}  {'met' if q >= target else 'MISSED'}"
        lines.append(f"  {label:<50} {q:5.2f}x  {verdict}")

    for mode in ALL_MODES:
        me = best.get((mode, "internlm_core"))
        for peer in ("bare_loop", "hf_trainer"):
            ratio_line(f"{MODE_TITLES[mode]}: internlm-core / {peer}", me, best.get((mode, peer)),
                       TARGETS.get((mode, peer)))
        if mode.endswith("compile"):
            eager = "bf16" if mode == "bf16_compile" else "fp32"
            ratio_line(f"{MODE_TITLES[mode]}: internlm-core / own {MODE_TITLES[eager]}", me,
                       best.get((eager, "internlm_core")), TARGETS.get((mode, f"eager:{eager}")))
    f32, b16 = best.get(("fp32", "internlm_core")), best.get(("bf16", "internlm_core"))
    if f32 and b16:
        d = b16["final_loss"] / f32["final_loss"] - 1
        lines.append(f"  {'internlm-core bf16 final loss vs fp32':<50} {d:+5.2%}   within 1%  "
                     f"{'met' if abs(d) <= 0.01 else 'MISSED'}")
    if max(x for x in loads if x is not None) > LOAD_WARN:
        lines += ["", f"WARNING: other processes used the CPUs during timing (other load up to "
                      f"{max(x for x in loads if x is not None):.2f} cores > {LOAD_WARN}): "
                      "the numbers above are contaminated; rerun when the machine is idle"]
    real = out / "real_data" / "table.txt"
    if real.exists():
        lines += ["", real.read_text().rstrip()]
    return "\n".join(lines)


def check_dependencies() -> None:
    missing = []
    for mod in ("transformers", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        sys.exit(f"error: {', '.join(missing)} not installed; run `make bench` (it installs requirements-dev.txt) "
                 f"or `{sys.executable} -m pip install -r requirements-dev.txt`")
    if not (PEERS_DIR / "workload.py").exists():
        sys.exit(f"error: the peers are not at {PEERS_DIR} (set PEERS_DIR)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results folder (default bench/results/<date-time>)")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated subset of {','.join(ALL_MODES)}")
    p.add_argument("--systems", default=None, help="comma-separated subset of hf_trainer,hf_loop,bare_loop,internlm_core")
    p.add_argument("--repeat", type=int, default=1, help="runs of each (mode, system), round robin")
    p.add_argument("--skip-real", action="store_true", help="skip the real-document comparison")
    p.add_argument("--skip-extras", action="store_true",
                   help="skip the other benchmarks of bench/ (tokenizer, loader, checkpoint), run after the table")
    p.add_argument("--table", default=None, metavar="DIR", help="only print the table of an earlier run")
    a = p.parse_args(argv)
    if a.table:
        print(table(Path(a.table)))
        return 0
    check_dependencies()
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        sys.exit(f"error: --modes: unknown {bad}; choose from {ALL_MODES}")
    only = set(a.systems.split(",")) if a.systems else None
    out = Path(a.out or ROOT / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load1 = os.getloadavg()[0]
    log(f"results in {out}; load average (1 min) {load1:.2f}"
        + ("  -- WARNING: the machine is busy, timings will be contaminated" if load1 > 0.3 else ""))
    t0 = time.perf_counter()
    log("== peak_flops")
    run_peer("peak_flops", "fp32", out)
    log("== hw_peak (the same products on oneDNN)")
    run_peer("hw_peak", "fp32", out)
    for k in range(a.repeat):
        for mode in modes:
            for system in SYSTEMS[mode]:
                if only and system not in only:
                    continue
                log(f"== {mode} {system}" + (f" (repeat {k + 1}/{a.repeat})" if a.repeat > 1 else ""))
                run_peer(system, mode, out / mode / f"r{k}")
    if not a.skip_real:
        log("== real documents (bench/real_data.py)")
        rc = subprocess.call([sys.executable, str(HERE / "real_data.py"), "--out", str(out / "real_data")],
                             cwd=ROOT, env=ENV)
        if rc != 0:
            log(f"real_data.py failed with exit code {rc}")
    log(f"\nall runs took {time.perf_counter() - t0:.0f} s\n")
    text = table(out)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    if not a.skip_extras:
        for extra in EXTRAS:
            if (HERE / extra).exists():
                log(f"\n== {extra}")
                rc = subprocess.call([sys.executable, str(HERE / extra)], cwd=ROOT, env=ENV)
                if rc != 0:
                    log(f"{extra} failed with exit code {rc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
