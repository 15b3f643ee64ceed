"""Checks for a machine with a CUDA GPU, prepared to run as one command when one is lent:

1. the CUDA tests (`pytest -m cuda`: tests/test_cuda.py and every other test marked cuda, skipped without CUDA),
   which must all run and pass;
2. the cost of one verify pass against tree size (1, 4, 8, 16, 32, 64 nodes) on a random-weight model of Llama
   1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocabulary 128256) in bf16, timed
   by the library's own path (autotree.measure_step_costs: the heads' proposer, Slots.verify_inputs and one
   forward_block, as the decoding loop runs them), with the heads' drafting cost beside it.

Prints a table; writes gpu_check.json, gpu_check.md and the tests' log and JUnit XML into --out (default: $OUT,
else nothing is written). Exits 2 without a CUDA device, 1 when a test fails or none ran.

    python scripts/gpu_check.py
    python scripts/gpu_check.py --skip-tests --sizes 1 2 4 8 16 32 64 128 --context 1024
    python scripts/gpu_check.py --device cpu --shape tiny --skip-tests   # the timing code on CPU (tests/ does this)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's medusa_spec, installed or not

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from medusa_spec import MedusaConfig, MedusaModel  # noqa: E402
from medusa_spec.autotree import measure_step_costs  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def random_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama of SHAPES[shape] with random weights, built on `device` (no host copy of 1B weights)."""
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype).eval()


def time_verify(base_model: torch.nn.Module, sizes, context: int, repeats: int, num_heads: int = 4) -> list[dict]:
    """One row per tree size: the fastest of `repeats` verify passes of n nodes after `context` cached tokens, and
    of the heads' drafting of that tree (untrained heads on the base: only the costs count)."""
    mm = MedusaModel.from_base(base_model, MedusaConfig(num_heads=num_heads))
    verify, draft = measure_step_costs(mm, sizes=sizes, context=context, repeats=repeats)
    one = verify[min(verify)]
    return [{"nodes": n, "verify_ms": round(1000 * verify[n], 3), "verify_vs_smallest": round(verify[n] / one, 2),
             "draft_ms": round(1000 * draft[n], 3)} for n in sorted(verify)]


def markdown(rows: list[dict]) -> str:
    lines = ["| nodes | verify ms | verify / smallest tree | drafting ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['nodes']} | {r['verify_ms']:.3f} | {r['verify_vs_smallest']:.2f} | {r['draft_ms']:.3f} |"
              for r in rows]
    return "\n".join(lines)


def run_cuda_tests(out: Path | None) -> dict:
    """`pytest -m cuda` in the checkout; its counts from the JUnit XML (a run where every test skipped fails)."""
    junit = (out or Path(tempfile.mkdtemp())) / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if out is not None:
        (out / "cuda_tests.log").write_text(log)
    print(log[-6000:])
    counts = {"exit_code": done.returncode, "seconds": round(time.perf_counter() - start, 1)}
    if junit.is_file():
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts.update({key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")})
    counts["passed"] = done.returncode == 0 and counts.get("tests", 0) > 0 and counts.get("skipped", 1) == 0
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="device to time on (default: cuda)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="model shape (default: 1b)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the weights' dtype (default: "
                        "bfloat16)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64], help="tree sizes, in nodes")
    parser.add_argument("--context", type=int, default=256, help="tokens in the cache before the tree (default: 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes per size; the fastest counts")
    parser.add_argument("--skip-tests", action="store_true", help="time only")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default: $OUT)")
    args = parser.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              f"run it on a machine with an NVIDIA GPU and a CUDA build of torch, or try the timing code with "
              f"--device cpu --shape tiny --skip-tests", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "torch": torch.__version__, "shape": args.shape, "config": SHAPES[args.shape],
              "dtype": args.dtype, "context": args.context, "repeats": args.repeats}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    ok = True
    if not args.skip_tests:
        report["tests"] = run_cuda_tests(out)
        ok = report["tests"]["passed"]

    start = time.perf_counter()
    base = random_model(args.shape, args.device, DTYPES[args.dtype])
    report["build_seconds"] = round(time.perf_counter() - start, 1)
    report["parameters"] = sum(p.numel() for p in base.parameters())
    start = time.perf_counter()
    report["rows"] = time_verify(base, args.sizes, args.context, args.repeats)
    report["timing_seconds"] = round(time.perf_counter() - start, 1)

    table = markdown(report["rows"])
    title = (f"Verify pass against tree size: random Llama of {args.shape} shape ({report['parameters'] / 1e9:.2f}B "
             f"parameters), {args.dtype} on {report.get('gpu', args.device)}, after {args.context} cached tokens, "
             f"fastest of {args.repeats}")
    print(f"{title}\n\n{table}")
    if "tests" in report:
        print(f"\nCUDA tests: {report['tests']}")
    if out is not None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        (out / "gpu_check.md").write_text(f"{title}\n\n{table}\n")
        print(f"wrote {out}/gpu_check.json, gpu_check.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
