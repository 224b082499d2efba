"""Where the first training step's time goes: every Triton compilation it triggers, with a fresh Triton cache (GPU).

Builds a model as bench_family.py does (real widths, the benchmark's depth), runs one step at --seq and, with
--second-seq, one at another length (what compiles again when only the token count changes). Per compiled kernel:
its name, the compile-time constants that are not strides, the warps and the seconds (Triton's stage times where
its compilation listener exists). Then the step's wall time against the sum of the compilations.

    python benchmark/profile_compile.py --model deepseek_v4 --impl liger-dspine --seq 4096 --second-seq 6144
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class CompileLog:
    """Wraps ``triton.compiler.compile`` (what a JIT function calls on a cache miss) to time each compilation."""

    def __init__(self, triton):
        import triton.compiler as compiler_module

        self.records: list[dict] = []
        self.stages: dict[int, list] = {}
        self._compile = compiler_module.compile
        log = self

        def timed_compile(src, *args, **kwargs):
            started = time.perf_counter()
            kernel = log._compile(src, *args, **kwargs)
            log.records.append(dict(log.describe(src), seconds=time.perf_counter() - started, stages=log._last_stages))
            log._last_stages = None
            return kernel

        self._last_stages = None
        compiler_module.compile = timed_compile
        self.builds: list[float] = []  # C launchers compiled with the host compiler (Triton 3.6 builds one per
        build_module = getattr(__import__("triton.runtime.build").runtime, "build", None)  # kernel signature)
        if build_module is not None and hasattr(build_module, "_build"):
            build = build_module._build

            def timed_build(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return build(*args, **kwargs)
                finally:
                    log.builds.append(time.perf_counter() - started)

            build_module._build = timed_build
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(getattr(knobs, "compilation", None), "listener"):

            def listen(*, src, metadata, metadata_group, times, cache_hit):
                stages = [("ir", times.ir_initialization)] + list(times.lowering_stages)
                log._last_stages = [(name, us / 1e6) for name, us in stages]

            knobs.compilation.listener = listen

    @staticmethod
    def describe(src) -> dict:
        fn = getattr(src, "fn", None)
        name = getattr(getattr(fn, "fn", fn), "__name__", str(fn))
        constants = getattr(src, "constants", {}) or {}
        shown = {}
        for key, value in constants.items():
            label = key[0] if isinstance(key, tuple) else key
            label = fn.arg_names[label] if isinstance(label, int) and fn is not None else label
            if not str(label).startswith("stride") and value is not None:
                shown[str(label)] = value
        return dict(kernel=name, constants=shown)

    def take(self) -> tuple[list[dict], list[float]]:
        taken, self.records = self.records, []
        builds, self.builds = self.builds, []
        return taken, builds


def report(title: str, taken: tuple[list[dict], list[float]], wall_s: float) -> None:
    records, builds = taken
    total = sum(r["seconds"] for r in records)
    print(
        f"\n## {title}: wall {wall_s:.1f} s, {len(records)} compilations, {total:.1f} s compiling; "
        f"{len(builds)} launcher builds, {sum(builds):.1f} s"
    )
    by_kernel = collections.defaultdict(list)
    for record in records:
        by_kernel[record["kernel"]].append(record)
    print(f"{'seconds':>8} {'count':>5}  kernel")
    for name, mine in sorted(by_kernel.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1])):
        print(f"{sum(r['seconds'] for r in mine):8.2f} {len(mine):5d}  {name}")
    print("\nper compilation (slowest first): seconds, stages, constants")
    for record in sorted(records, key=lambda r: -r["seconds"]):
        stages = " ".join(f"{n}={s:.2f}" for n, s in record["stages"] or [])
        constants = json.dumps(record["constants"], default=str)
        print(f"{record['seconds']:7.2f}  {record['kernel']}  [{stages}]  {constants[:300]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek_v4", help="a model of family_configs.FAMILY")
    parser.add_argument("--impl", default="liger-dspine", help="hf, liger or liger-dspine")
    parser.add_argument("--layers", type=int, help="default: the family benchmark's depth")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--second-seq", type=int, default=0, help="also a step at this length (0: none)")
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="profile-compile-")  # cold, as a fresh machine

    import torch
    import triton

    from bench_deepseek_v3 import _apply_patch
    from family_configs import LIGER_DSPINE_OPTIONS
    from family_configs import family_class
    from family_configs import family_config
    from family_configs import family_layers

    log = CompileLog(triton)
    layers = args.layers or family_layers(args.model)
    options = LIGER_DSPINE_OPTIONS.get(args.model, {}) if args.impl == "liger-dspine" else {}
    _apply_patch(args.impl, options, args.model)
    config = family_config(args.model, layers, False, max(args.seq, args.second_seq))
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = family_class(args.model)(config)
        torch.set_default_dtype(torch.float32)
    model.train()

    def step(seq: int) -> float:
        ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        for p in model.parameters():
            p.grad = None
        return time.perf_counter() - started

    print(f"{args.model} {args.impl} {layers} layers, triton {triton.__version__}, torch {torch.__version__}")
    wall = step(args.seq)
    report(f"first step at {args.seq}", log.take(), wall)
    wall = step(args.seq)
    report(f"second step at {args.seq}", log.take(), wall)
    if args.second_seq:
        wall = step(args.second_seq)
        report(f"first step at {args.second_seq}", log.take(), wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
