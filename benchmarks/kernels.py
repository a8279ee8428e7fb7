"""Kernel benchmarks: the log-prob head on CPU; bandwidth and speedups of every kernel on a GPU.

    .venv/bin/python benchmarks/kernels.py            # CPU head table (docs/benchmarks.md, "Kernels")
    .venv/bin/python benchmarks/kernels.py --smoke    # every code path on tiny shapes (GPU part on CPU
                                                      # through TRITON_INTERPRET=1), a few seconds

CPU (always): forward + backward of the log-prob head at M tokens, vocabulary V, hidden H, as the
chunked torch autograd function (the CPU default) and as the naive log_softmax(hidden @ W.T)
gather. Peak memory is measured two ways:
- tensor peak: every CPU allocation and free of torch's allocator recorded by
  `torch.profiler.profile(profile_memory=True)`, replayed in time order (operator-internal
  temporaries included); counts what is allocated during the step, i.e. excludes the inputs;
- peak RSS: the high-water RSS (VmHWM, reset through /proc/self/clear_refs once the inputs are
  built) of a fresh child process running one step, minus its RSS at that point: what the
  process really holds, allocator caching and fragmentation included.
Time: median wall seconds of `--repeats` steps after one warm-up, no profiler attached.

GPU (only where `torch.cuda.is_available()`): head fwd+bwd (Triton, chunked torch, naive) against
the bare GEMMs of the same shapes; for the loss and advantage kernels the achieved bandwidth
(bytes read + written / time) as a fraction of a measured device-to-device copy, and speedups
against the eager torch reference and `torch.compile` of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from rlgraph.kernels import advantages as A  # noqa: E402
from rlgraph.kernels import logprob_head as head  # noqa: E402
from rlgraph.kernels import policy_loss as P  # noqa: E402
from rlgraph.kernels import sampling as S  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------- measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of `fn` over `repeats` calls after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_tensor_peak(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors allocated while `fn` runs (profiler allocation events, replayed)."""
    from torch.profiler._memory_profiler import Action, MemoryProfile  # the engine of export_memory_timeline

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, (key, _), size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if key.device.type != "cpu" or action == Action.PREEXISTING:
            continue
        current += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, current)
    return peak


def cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on `device` while `fn` runs, above what was allocated before."""
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def _status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process from /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


# ----------------------------------------------------------------------------- the head


def naive_head(hidden, weight, targets, *, temperature=1.0, with_entropy=False, chunk_size=None):
    """The baseline: full f32 logits [M, V], log_softmax, gather (what most trainers do)."""
    logp = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)  # [M, V]
    return logp.gather(-1, targets[:, None]).squeeze(-1), None


HEADS = {"naive": naive_head, "chunked": head.token_logprobs_chunked, "triton": head.token_logprobs_triton}


def head_inputs(M: int, V: int, H: int, device: torch.device, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, V, (M,), generator=gen).to(device)
    grad = torch.randn(M, generator=gen).to(device)
    return hidden, weight, targets, grad


def head_step(impl: str, hidden, weight, targets, grad, chunk: int | None) -> None:
    """One forward + backward; gradients w.r.t. hidden and weight, dropped at the end."""
    lp, _ = HEADS[impl](hidden, weight, targets, chunk_size=chunk)
    torch.autograd.grad((lp * grad).sum(), [hidden, weight])


def _rss_child(args: argparse.Namespace) -> None:
    """In a fresh process: build the inputs, then print the peak-RSS growth of one step."""
    torch.set_num_threads(args.threads)
    inputs = head_inputs(args.tokens, args.vocab, args.hidden, torch.device("cpu"))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec from the parent.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    baseline = _status_bytes("VmRSS")
    head_step(args.rss_child, *inputs, args.chunk)
    print(_status_bytes("VmHWM") - baseline)


def _peak_rss(impl: str, args: argparse.Namespace) -> int:
    command = [sys.executable, __file__, "--rss-child", impl, "--tokens", str(args.tokens), "--vocab",
               str(args.vocab), "--hidden", str(args.hidden), "--threads", str(args.threads)]
    if args.chunk:
        command += ["--chunk", str(args.chunk)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def cpu_head_table(args: argparse.Namespace) -> list[str]:
    device = torch.device("cpu")
    inputs = head_inputs(args.tokens, args.vocab, args.hidden, device)
    chunk = args.chunk or head.default_chunk_size(args.tokens, args.vocab, args.hidden)
    rows = {}
    for impl in ("naive", "chunked"):
        step = lambda impl=impl: head_step(impl, *inputs, chunk)  # noqa: E731
        rows[impl] = (cpu_tensor_peak(step), _peak_rss(impl, args) if not args.smoke else 0,
                      median_seconds(step, args.repeats, device))
    naive, chunked = rows["naive"], rows["chunked"]
    lines = [f"log-prob head fwd+bwd, M={args.tokens} V={args.vocab} H={args.hidden} f32, chunk={chunk}, "
             f"{torch.get_num_threads()} threads",
             "| head | tensor peak MiB | peak RSS MiB | median s |", "| --- | --- | --- | --- |"]
    for impl, (tensor_peak, rss, seconds) in rows.items():
        lines.append(f"| {impl} | {tensor_peak / MiB:.0f} | {rss / MiB:.0f} | {seconds:.2f} |")
    lines.append(f"ratios naive/chunked: tensor peak {naive[0] / chunked[0]:.1f}x, peak RSS "
                 f"{naive[1] / max(chunked[1], 1):.1f}x; time chunked/naive {chunked[2] / naive[2]:.2f}x")
    return lines


# ----------------------------------------------------------------------------- GPU tables


def copy_bandwidth(device: torch.device, numel: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy (read + write): the practical bandwidth ceiling."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), repeats, device)


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _kernel_cases(N: int, T: int, device: torch.device):
    """(name, reference, triton, args, kwargs, bytes moved) for the loss and advantage kernels."""
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(N, T, generator=gen).to(device).requires_grad_()
    old, ref, values = (torch.randn(N, T, generator=gen).to(device) for _ in range(3))
    adv = torch.randn(N, generator=gen).to(device)
    mask = (torch.rand(N, T, generator=gen) > 0.1).to(device)
    rewards = torch.randint(0, 2, (N,), generator=gen).float().to(device)
    group = (torch.arange(N) // 8).to(device)

    def loss_fwd_bwd(impl):
        def run():
            out = impl(lp, old, adv, mask, ref_lp=ref, kl_coef=0.01, dual_clip=3.0, clip_high=0.28)
            torch.autograd.grad(out.loss, [lp])
        return run

    loss_bytes = _bytes(lp, old, ref, mask) + adv.numel() * 4 + lp.numel() * 4  # inputs + grad
    return [
        ("policy loss fwd+bwd", loss_fwd_bwd(P.policy_loss_reference), loss_fwd_bwd(P.policy_loss_triton),
         loss_bytes),
        ("group_normalize", lambda: A.group_normalize_reference(rewards, group),
         lambda: A.group_normalize_triton(rewards, group), _bytes(rewards, group, rewards)),
        ("rloo", lambda: A.rloo_reference(rewards, group), lambda: A.rloo_triton(rewards, group),
         _bytes(rewards, group, rewards)),
        ("gae", lambda: A.gae_reference(old, values, mask, gamma=0.99, lam=0.95),
         lambda: A.gae_triton(old, values, mask, gamma=0.99, lam=0.95), _bytes(old, values, mask, old, old)),
        ("discounted_returns", lambda: A.discounted_returns_reference(old, mask, gamma=0.99),
         lambda: A.discounted_returns_triton(old, mask, gamma=0.99), _bytes(old, mask, old)),
    ]


def sampling_table(device: torch.device, N: int, V: int, repeats: int) -> list[str]:
    """The fused sampler (one pass over the logits) against the torch reference ([N, V] int64 hash
    words and float noise), with the peak memory each allocates beyond the logits."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=gen) * 3).to(device=device, dtype=torch.bfloat16 if device.type == "cuda"
                                                                  else torch.float32)  # [N, V]
    keys = S.splitmix64(torch.tensor(7), torch.arange(N)).to(device)  # [N]
    ceiling = copy_bandwidth(device, max(logits.numel(), 1 << 16), repeats)
    peak = cuda_peak if device.type == "cuda" else (lambda fn, _device: cpu_tensor_peak(fn))
    lines = [f"sampling, N={N} V={V} {logits.dtype}; copy bandwidth {ceiling / 1e9:.0f} GB/s",
             "| sampler | ms | fraction of copy BW (logits read once) | peak MiB |", "| --- | --- | --- | --- |"]
    for name, fn in (("fused (triton)", lambda: S.gumbel_sample_triton(logits, keys, 1.0)),
                     ("reference (torch)", lambda: S.gumbel_sample_reference(logits, keys, 1.0))):
        seconds = median_seconds(fn, repeats, device)
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {_bytes(logits) / seconds / ceiling:.2f} | "
                     f"{peak(fn, device) / MiB:.0f} |")
    return lines


def _compiled(fn: Callable[[], object], enabled: bool) -> Callable[[], object] | None:
    if not enabled:
        return None
    compiled = torch.compile(fn)
    try:
        compiled()
    except Exception as exc:  # noqa: BLE001 - report, do not fail the whole benchmark
        print(f"  torch.compile failed: {type(exc).__name__}: {exc}")
        return None
    return compiled


def kernel_table(device: torch.device, N: int, T: int, repeats: int, compile_: bool) -> list[str]:
    ceiling = copy_bandwidth(device, max(N * T * 4, 1 << 16), repeats)
    lines = [f"loss/advantage kernels, N={N} T={T}; copy bandwidth {ceiling / 1e9:.0f} GB/s",
             "| kernel | triton ms | fraction of copy BW | eager ms | speedup vs eager | compile ms "
             "| speedup vs compile |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, reference, triton_fn, moved in _kernel_cases(N, T, device):
        fused = median_seconds(triton_fn, repeats, device)
        eager = median_seconds(reference, repeats, device)
        compiled = _compiled(reference, compile_)
        comp = median_seconds(compiled, repeats, device) if compiled else float("nan")
        lines.append(f"| {name} | {fused * 1e3:.3f} | {moved / fused / ceiling:.2f} | {eager * 1e3:.3f} | "
                     f"{eager / fused:.1f}x | {comp * 1e3:.3f} | {comp / fused:.1f}x |")
    return lines


def _gemms(M: int, V: int, H: int, device: torch.device, dtype) -> Callable[[], object]:
    """The three GEMMs of a head step (logits, grad hidden, grad weight) and nothing else."""
    hidden, weight = torch.randn(M, H, device=device, dtype=dtype), torch.randn(V, H, device=device, dtype=dtype)
    grad_logits = torch.randn(M, V, device=device, dtype=dtype)

    def run():
        hidden @ weight.t()
        grad_logits @ weight
        grad_logits.t() @ hidden
    return run


def gpu_head_table(device: torch.device, M: int, V: int, H: int, repeats: int, dtype) -> list[str]:
    inputs = head_inputs(M, V, H, device, dtype)
    gemm_seconds = median_seconds(_gemms(M, V, H, device, dtype), repeats, device)
    peak = cuda_peak if device.type == "cuda" else (lambda fn, _device: cpu_tensor_peak(fn))
    lines = [f"log-prob head fwd+bwd, M={M} V={V} H={H} {dtype}; bare GEMMs (3) {gemm_seconds * 1e3:.2f} ms",
             "| head | ms | x bare GEMMs | peak MiB |", "| --- | --- | --- | --- |"]
    for impl in ("triton", "chunked", "naive"):
        step = lambda impl=impl: head_step(impl, *inputs, None)  # noqa: E731
        seconds = median_seconds(step, repeats, device)
        lines.append(f"| {impl} | {seconds * 1e3:.2f} | {seconds / gemm_seconds:.2f} "
                     f"| {peak(step, device) / MiB:.0f} |")
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: default_chunk_size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; GPU tables run on CPU (interpreter)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--rss-child", choices=sorted(HEADS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        _rss_child(args)
        return 0
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.repeats = 64, 97, 32, 1
    print("\n".join(cpu_head_table(args)))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu") if args.smoke else None
    if device is None:
        print("GPU tables: skipped, no CUDA device (torch.cuda.is_available() is False)")
        return 0
    big = device.type == "cuda"
    dtype = torch.bfloat16 if big else torch.float32
    print("\n".join(gpu_head_table(device, *((8192, 32000, 4096) if big else (32, 50, 16)), args.repeats, dtype)))
    print("\n".join(kernel_table(device, *((4096, 4096) if big else (12, 9)), args.repeats if big else 1,
                                 compile_=not args.no_compile)))
    print("\n".join(sampling_table(device, *((512, 151936) if big else (4, 300)), args.repeats if big else 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
