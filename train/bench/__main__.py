"""python -m train.bench: the rows, the table, bench.json and the scaling chart."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from train.base.errors import ConfigError, OneLineParser, fail
from train.bench import GPU_KNOBS
from train.cluster.identity import usable_cores
from train.files.rundir import to_json

# The rows' modules (and torch with them) are imported once the command line is read (row_groups): a mistake in it is
# its one line at once.


# ---------------------------------------------------------------- report

def chart(path: Path, bars: dict[str, float]) -> None:
    """A PNG bar chart of the scaling arms (samples/s), with the ideal 2-rank line."""
    from PIL import Image, ImageDraw  # noqa: PLC0415 - once the command line is read

    width, height, left, bottom = 720, 360, 60, 300
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    top_value = max(max(bars.values()), 2 * bars["1 rank x 1 thread"]) * 1.1
    scale = (bottom - 40) / top_value
    draw.text((left, 10), "trainbox weak scaling on this machine (samples/s, CPU)", fill="black")
    draw.line([(left, bottom), (width - 20, bottom)], fill="black")
    slot = (width - left - 40) // len(bars)
    for i, (label, value) in enumerate(bars.items()):
        x0 = left + i * slot + 15
        draw.rectangle([x0, bottom - value * scale, x0 + slot - 30, bottom],
                       fill=(70, 110, 180) if "bare" not in label else (160, 160, 160))
        draw.text((x0, bottom - value * scale - 14), f"{value:.0f}", fill="black")
        draw.text((x0, bottom + 8), label, fill="black")
    ideal = bottom - 2 * bars["1 rank x 1 thread"] * scale
    draw.line([(left, ideal), (width - 20, ideal)], fill=(200, 60, 60))
    draw.text((width - 230, ideal - 14), "ideal 2 ranks = 2 x (1 rank x 1 thread)", fill=(200, 60, 60))
    image.save(path)


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", f"{'ratio':>6} {'spread':>13} {'target':>7}  row", "-" * 100]
    for r in rows:
        mark = "" if r["meets_target"] is None else (" ok" if r["meets_target"] else " MISSED")
        lines.append(f"{r['ratio']:6.3f} {r['low']:6.3f}-{r['high']:<6.3f} {r['target']:>7}  {r['row']}{mark}")
        lines.append(f"{'':29}{r['detail']}")
    return "\n".join(lines)


SIZES = {
    "full": {"steps": 100, "window": 10, "warmup": 2, "samples": 4096, "width": 32, "batch": 64, "blocks": 8,
             "per_block": 5, "files": 3000, "loader_batches": 30, "gpu_batch": 256, "gpu_steps": 80,
             "photos": 600, "many_files": 50_000, "gpu_photos": 5120, "camera_photos": 40,
             "lm_samples": 2048, "lm_batch": 32, "quick": False},
    "quick": {"steps": 2, "window": 1, "warmup": 1, "samples": 128, "width": 8, "batch": 16, "blocks": 2,
              "per_block": 1, "files": 120, "loader_batches": 3, "gpu_batch": 32, "gpu_steps": 8,
              "photos": 24, "many_files": 600, "gpu_photos": 64, "camera_photos": 4,
              "lm_samples": 64, "lm_batch": 4, "quick": True},
}


def parse(argv: list[str]) -> argparse.Namespace | int:
    """The command line, or the exit code of a refusal (one line on stderr)."""
    parser = OneLineParser(prog="python -m train.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=time.strftime("runs/bench-%Y%m%d-%H%M%S"), help="output folder")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B rounds per comparison")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every row runs (--rounds 1 "
                                                             "allowed)")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (needs CUDA)")
    parser.add_argument("--gpu-knobs", default=",".join(GPU_KNOBS),
                        help=f"GPU knobs to measure, comma-separated from {','.join(GPU_KNOBS)} (default: all)")
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        return fail(e)
    ns.knobs = [k for k in ns.gpu_knobs.split(",") if k]
    if ns.bare:
        return ns
    if ns.rounds < (1 if ns.quick else 2):  # --quick checks that every row runs: once is enough for that
        print("error: --rounds must be at least 2 to report a spread: pass --rounds 2 or more (--quick alone takes "
              "--rounds 1: every row once)", file=sys.stderr)
        return 2
    if unknown := sorted(set(ns.knobs) - set(GPU_KNOBS)):
        print(f"error: unknown --gpu-knobs {','.join(unknown)}: pick from {','.join(GPU_KNOBS)}", file=sys.stderr)
        return 2
    import torch  # noqa: PLC0415 - the mistakes above are answered without it

    if ns.gpu_only and not torch.cuda.is_available():
        print("error: --gpu-only needs a CUDA GPU and none is visible: drop --gpu-only or check nvidia-smi",
              file=sys.stderr)
        return 2
    return ns


def row_groups(ns: argparse.Namespace, out: Path, size: dict, bars: dict) -> list:
    """The groups of rows to measure, in order: each a function that returns its rows (the trainer's group also
    fills `bars`, the scaling chart's)."""
    import torch  # noqa: PLC0415 - the rows' modules, once the command line is read

    from train.bench.arms import bare_arms_at_once  # noqa: PLC0415
    from train.bench.camera import camera_rows  # noqa: PLC0415
    from train.bench.cpu import checkpoint_rows, comm_rows, shapes_bare, trainer_rows  # noqa: PLC0415
    from train.bench.gpu import gpu_rows, jpeg_rows  # noqa: PLC0415
    from train.bench.photos import photo_rows  # noqa: PLC0415
    from train.bench.pipeline import pipeline_rows, shard_rows  # noqa: PLC0415
    from train.bench.pixels import segmentation_bare, segmentation_rows  # noqa: PLC0415
    from train.bench.sources import source_rows  # noqa: PLC0415
    from train.bench.tokens import lm_bare, lm_rows, sharding_rows  # noqa: PLC0415

    groups = []
    if not ns.gpu_only:
        def bare_group():  # --quick: every bare loop below in one launch; each row takes its own (arms.bare_arm)
            bare_arms_at_once(out, [shapes_bare(size), segmentation_bare(size), *lm_bare(out, size)])
            return []

        def trainer_group():
            loop, exactness, recipe, measured = trainer_rows(out, size, ns.rounds)
            bars.update(measured)
            return [*loop, *comm_rows(out, size), *exactness, *recipe]

        groups += [bare_group] if size["quick"] else []
        groups += [trainer_group, lambda: segmentation_rows(out, size, ns.rounds),
                   lambda: lm_rows(out, size, ns.rounds), lambda: sharding_rows(out, size),
                   lambda: pipeline_rows(out, size, ns.rounds),
                   lambda: photo_rows(out, size, ns.rounds), lambda: camera_rows(out, size, ns.rounds),
                   lambda: shard_rows(out, size, ns.rounds),
                   lambda: source_rows(out, size, ns.rounds),  # after shard_rows: the same folder
                   lambda: checkpoint_rows(out, size, ns.rounds)]
    if torch.cuda.is_available():
        groups.append(lambda: gpu_rows(out, size, ns.rounds, ns.knobs))
        if "jpeg" in ns.knobs:
            groups.append(lambda: jpeg_rows(out, size, ns.rounds))
    return groups


def main(argv: list[str]) -> int:
    ns = parse(argv)
    if isinstance(ns, int):
        return ns
    import torch  # noqa: PLC0415 - once the command line is read

    from train.bench.arms import bare_main  # noqa: PLC0415
    from train.bench.photos import sample_photos  # noqa: PLC0415

    if ns.bare:
        bare_main(ns.bare)
        return 0
    if not ns.gpu_only:
        try:
            sample_photos()
        except ConfigError as e:
            return fail(e)
    size = SIZES["quick" if ns.quick else "full"]
    out = Path(ns.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    started = time.monotonic()
    header = (f"trainbox bench: torch {torch.__version__}, {cores} CPU cores, "
              f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
              f"{ns.rounds} interleaved rounds; ratio = median, spread = lowest-highest round")
    print(f"bench: measuring into {out}{'' if ns.gpu_only else ' (about 12 minutes on 2 cores)'}", file=sys.stderr,
          flush=True)
    rows, bars = [], {}

    def written(failure: str | None = None) -> str:
        """bench.txt and bench.json as they stand: written after each group of rows, so a bench cut off by a time
        limit or stopped by a failed arm keeps the rows it measured."""
        text = table(rows, header) + f"\n\n{time.monotonic() - started:.0f} s; written to {out}"
        text += f"\n\nstopped: {failure}" if failure else ""
        (out / "bench.txt").write_text(text + "\n")
        (out / "bench.json").write_text(to_json({"header": header, "rows": rows, "scaling_samples_per_s": bars,
                                                    "sizes": size, "rounds": ns.rounds,
                                                    **({"stopped": failure} if failure else {})}, indent=2) + "\n")
        return text

    for group in row_groups(ns, out, size, bars):
        try:
            rows += group()
        except SystemExit as e:  # an arm that failed (arms.run): the rows so far stay, with the reason
            print(written(str(e.code).splitlines()[0]))
            print(e.code, file=sys.stderr)
            return 1
        written()
    if bars:
        chart(out / "scaling.png", bars)
    print(written())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
