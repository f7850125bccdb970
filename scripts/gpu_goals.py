"""Issue 35's GPU goals, one table, from the JSON files scripts/gpu_check.sh leaves: train_bench.py's (plain
PyTorch and strata's runs of one model, same run), `strata bench io`'s (the drive, against fio), and
large_bench.py's (the 7B Llama).

    python3 scripts/gpu_goals.py [--train TRAIN.json] [--io IO.json] [--large LARGE.json] [--json OUT]

A row a run: s/step, x plain PyTorch, the step phase's share of the step, the plan's predicted step and
measured / predicted, and for the nvme run the bytes it moved to and from NVMe a second beside the drive's own
speed; then each goal met or not met (a goal whose figure is missing: no figure). Exit status 0 whatever the
verdicts: the table is the result.
"""

import argparse
import json
import sys

FITS_X_PLAIN = 0.9          # fits: at least this fraction of plain PyTorch's speed
OVERLAP_X_PLAIN = 0.7       # streamed+overlap: at least this fraction
OVERLAP_STEP_SHARE = 0.15   # streamed+overlap: the step phase (after backward) at most this share of the step
PLAN_TOLERANCE = 0.15       # every run: the plan's predicted step within this fraction of the measured one
LARGE_MFU = 0.40            # the 7B Llama: at least this model FLOPs utilization
RUNS = ("fits", "streamed", "streamed+overlap", "nvme")
NVME_LINKS = ("host->nvme", "nvme->host", "device->nvme", "nvme->device")


def verdict(value, threshold, at_least):
    """'met', 'not met', or 'no figure' where the value is missing."""
    if value is None:
        return "no figure"
    return "met" if (value >= threshold if at_least else value <= threshold) else "not met"


def plan_goal(measured, predicted):
    """(measured / predicted, verdict): within PLAN_TOLERANCE either way."""
    if not measured or not predicted:
        return None, "no figure"
    ratio = measured / predicted
    return ratio, verdict(abs(ratio - 1), PLAN_TOLERANCE, at_least=False)


def drive_speed(io):
    """The drive's read and write GB/s from bench io's JSON: fio's medians where it ran, else strata's own (the
    best row of each op); and whose figures they are."""
    speeds, source = {}, "fio"
    rows = io.get("results", [])
    if not any("fio_median_gbps" in r for r in rows):
        source = "strata"
    for row in rows:
        gbps = row.get("fio_median_gbps" if source == "fio" else "strata_median_gbps")
        if gbps is not None:
            speeds[row["op"]] = max(gbps, speeds.get(row["op"], 0.0))
    return {"read_gbps": speeds.get("read"), "write_gbps": speeds.get("write"), "source": source}


def train_rows(train):
    """A row a run of train_bench's results, with its goals."""
    results = train["results"]
    plain = results.get("plain", {}).get("s_per_step")
    rows = []
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        seconds = r["s_per_step"]
        x_plain = plain / seconds if plain else None
        share = r["step_phase_s"] / seconds
        ratio, plan = plan_goal(seconds, r.get("predicted_step_s"))
        goals = []
        if name == "fits":
            goals.append((f"x plain >= {FITS_X_PLAIN}", verdict(x_plain, FITS_X_PLAIN, True)))
        if name == "streamed+overlap":
            goals.append((f"x plain >= {OVERLAP_X_PLAIN}", verdict(x_plain, OVERLAP_X_PLAIN, True)))
            goals.append((f"step <= {OVERLAP_STEP_SHARE:.0%}", verdict(share, OVERLAP_STEP_SHARE, False)))
        goals.append((f"plan within {PLAN_TOLERANCE:.0%}", plan))
        row = {"run": name, "s_per_step": seconds, "x_plain": x_plain, "step_share": share,
               "predicted_step_s": r.get("predicted_step_s"), "measured_over_predicted": ratio, "goals": goals}
        nvme_bytes = sum(r.get("bytes_per_step", {}).get(link, 0) for link in NVME_LINKS)
        if nvme_bytes:
            row["nvme_gbps"] = nvme_bytes / seconds / 1e9
        rows.append(row)
    return rows


def large_row(large):
    r = large["result"]
    ratio, plan = plan_goal(r["s_per_step"], r.get("predicted_step_s"))
    phase = r.get("step_phase_s")
    return {"run": f"{r['parameters'] / 1e9:.1f}B llama", "s_per_step": r["s_per_step"],
            "step_share": None if phase is None else phase / r["s_per_step"],
            "tokens_per_s": r["tokens_per_s"], "mfu": r.get("mfu"), "predicted_step_s": r.get("predicted_step_s"),
            "measured_over_predicted": ratio,
            "goals": [(f"MFU >= {LARGE_MFU:.0%}", verdict(r.get("mfu"), LARGE_MFU, True)),
                      (f"plan within {PLAN_TOLERANCE:.0%}", plan)]}


def _f(value, spec):
    return "-" if value is None else format(value, spec)


def print_train(train, rows, drive):
    a = train["args"]
    plain = train["results"].get("plain", {}).get("s_per_step")
    print(f"goals: {a.get('model', '?')} of {a.get('layers')} layers of {a.get('hidden')}, {a.get('batch')} x "
          f"{a.get('seq')} tokens, {a.get('precision')}, device {a.get('device')}; plain PyTorch {_f(plain, '.4f')} "
          "s/step in the same run")
    print(f"{'run':<18}{'s/step':>8}{'x plain':>9}{'step %':>8}{'plan s':>8}{'meas/plan':>10}  "
          f"{'NVMe GB/s (drive)':<30}goals")
    for r in rows:
        nvme = ""
        if "nvme_gbps" in r:
            nvme = (f"{r['nvme_gbps']:.2f} (r {_f(drive.get('read_gbps'), '.2f')} w "
                    f"{_f(drive.get('write_gbps'), '.2f')} {drive.get('source', '')})" if drive else
                    f"{r['nvme_gbps']:.2f}")
        share = _f(None if r["step_share"] is None else 100 * r["step_share"], ".0f")
        goals = "; ".join(f"{goal}: {v}" for goal, v in r["goals"])
        print(f"{r['run']:<18}{r['s_per_step']:>8.4f}{_f(r['x_plain'], '.2f'):>9}{share:>8}"
              f"{_f(r['predicted_step_s'], '.4f'):>8}{_f(r['measured_over_predicted'], '.2f'):>10}  "
              f"{nvme:<30}{goals}")


def print_large(large, row):
    a = large["args"]
    print(f"goals: llama of {a['layers']} layers of {a['hidden']}, {a['micro_batches']} x {a['batch']} x {a['seq']} "
          f"tokens a step, bf16, device {a['device']}, peak {a.get('peak_tflops')} TFLOPS")
    print(f"{'run':<18}{'s/step':>8}{'step %':>8}{'tokens/s':>10}{'MFU':>7}{'plan s':>8}{'meas/plan':>10}  goals")
    goals = "; ".join(f"{goal}: {v}" for goal, v in row["goals"])
    share = _f(None if row["step_share"] is None else 100 * row["step_share"], ".0f")
    print(f"{row['run']:<18}{row['s_per_step']:>8.3f}{share:>8}{row['tokens_per_s']:>10.0f}{_f(row['mfu'], '.3f'):>7}"
          f"{_f(row['predicted_step_s'], '.3f'):>8}{_f(row['measured_over_predicted'], '.2f'):>10}  {goals}")


def load(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        print(f"gpu_goals: {what} ({path}) not read: {error}", file=sys.stderr)
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", help="train_bench.py's JSON")
    p.add_argument("--io", help="strata bench io's JSON (the drive beside the nvme run)")
    p.add_argument("--large", help="large_bench.py's JSON")
    p.add_argument("--json", help="write the rows and verdicts here")
    args = p.parse_args(argv)
    out = {}
    io = load(args.io, "the drive's figures") if args.io else None
    drive = drive_speed(io) if io else None
    train = load(args.train, "the training runs") if args.train else None
    if train:
        out["train"] = train_rows(train)
        out["drive"] = drive
        print_train(train, out["train"], drive)
    elif args.train:
        print("goals: the training runs left no figures (see their log)")
    large = load(args.large, "the large run") if args.large else None
    if large:
        out["large"] = large_row(large)
        print_large(large, out["large"])
    elif args.large:
        print("goals: the large run left no figures (see its log)")
    rows = out.get("train", []) + ([out["large"]] if "large" in out else [])
    verdicts = [v for r in rows for _, v in r["goals"]]
    print(f"goals met: {verdicts.count('met')} of {len(verdicts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
