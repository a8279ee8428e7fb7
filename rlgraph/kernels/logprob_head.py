"""Per-token log-probs (and entropy) from hidden states and the LM-head weight, chunked.

    z[m]   = hidden[m] @ weight.T / temperature              # [V], never held for all m at once
    lp[m]  = z[m, targets[m]] - logsumexp(z[m])
    ent[m] = -sum_v p[m, v] log p[m, v],   p[m] = softmax(z[m])

Gradients with respect to the logits, for upstream gradients g_lp[m] and g_ent[m]:

    d lp[m]  / d z[m, v] = 1[v == targets[m]] - p[m, v]
    d ent[m] / d z[m, v] = -p[m, v] * (log p[m, v] + ent[m])

then grad_hidden = gz @ weight / temperature and grad_weight = gz.T @ hidden / temperature.

Three implementations share that math:
- `token_logprobs_reference`: the naive oracle; materialises [M, V] (tests only).
- the chunked torch autograd function (CPU default): forward keeps only lse[M] (and ent[M]);
  backward recomputes one [chunk, V] block of logits at a time.
- the Triton kernels (CUDA; CPU under TRITON_INTERPRET=1): the forward fuses the matmul with an
  online log-sum-exp over vocab tiles and writes no logits at all; the backward recomputes the
  logits of one token chunk tile by tile, writes that chunk's gz [chunk, V] and leaves the two
  gradient matmuls to cuBLAS. Peak extra memory is one [chunk, V] block, never [M, V].
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no triton
    triton = None

# The most tokens per [chunk, V] block; `default_chunk_size` picks fewer for large vocabularies.
DEFAULT_CHUNK = 1024
MIN_CHUNK = 16
BLOCK_FLOOR_ELEMENTS = 1 << 22  # 16 MiB of f32 logits
GPU_MIN_CHUNK = 256


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: one f32 [chunk, V] block about as large as hidden [M, H], and >= 16 MiB.

    chunk = next_pow2(ceil(max(M * H, 2**22) / V)), clamped to [16, 1024]. M=8192, V=32000,
    H=512 gives 256: a 33 MB block instead of 1 GB of logits. The 16 MiB floor keeps the chunk
    GEMMs large enough to run at full speed for small M. `rlgraph.plan.memory` should mirror this
    rule for its logits estimate.
    """
    elements = max(tokens * hidden, BLOCK_FLOOR_ELEMENTS)
    wanted = -(-elements // max(vocab, 1))  # ceil
    return max(MIN_CHUNK, min(DEFAULT_CHUNK, 1 << (wanted - 1).bit_length()))


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    matched = hidden.dim() == weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    if not matched or targets.shape != hidden.shape[:1]:
        raise ValueError("token_logprobs: need hidden [M, H], weight [V, H] and targets [M]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if not temperature > 0.0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")


# ----------------------------------------------------------------------------- reference


def token_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             temperature: float = 1.0, with_entropy: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Naive oracle: full f32 logits [M, V], log_softmax, gather. Same contract as `token_logprobs`."""
    _check(hidden, weight, targets, temperature)
    logp = torch.log_softmax(hidden.float() @ weight.float().t() / temperature, dim=-1)  # [M, V]
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [M]
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None  # [M]
    return lp, entropy


# ----------------------------------------------------------------------------- chunked torch


def _chunk_logp(h_scaled: torch.Tensor, weight32: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Fill `logp` [c, V] with log softmax(h_scaled @ W.T); return lse [c]. No other [c, V] temporary."""
    torch.mm(h_scaled, weight32.t(), out=logp)  # [c, V] logits
    peak = logp.amax(dim=-1, keepdim=True)  # [c, 1]
    logp.sub_(peak)
    lse = torch.exp(logp).sum(-1, keepdim=True).log_()  # [c, 1]; exp's output is the one temporary
    logp.sub_(lse)
    return (lse + peak).squeeze(1)


def _chunk_grad_logits(logp: torch.Tensor, p: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor,
                       entropy: torch.Tensor | None, g_ent: torch.Tensor | None) -> torch.Tensor:
    """gz [c, V] = g_lp (onehot - p) - g_ent p (log p + ent), written over `logp` or `p`."""
    torch.exp(logp, out=p)  # [c, V]
    if entropy is None:
        grad = p.mul_(-g_lp[:, None])  # [c, V]
    else:
        grad = logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None])  # [c, V]
        grad.addcmul_(p, g_lp[:, None], value=-1.0)
    return grad.scatter_add_(1, targets[:, None], g_lp[:, None])


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Chunked torch head: saves inputs + lse (+ entropy), recomputes logits chunk by chunk.

    Two [chunk, V] f32 buffers are allocated once per call and reused for every chunk, so the
    allocator sees no churn of large blocks (which would otherwise inflate the process RSS).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk):
        M, V = hidden.shape[0], weight.shape[0]
        weight32 = weight.float()
        lp = hidden.new_empty(M, dtype=torch.float32)  # [M]
        lse = torch.empty_like(lp)  # [M]
        entropy = torch.zeros_like(lp)  # [M]
        logp_buf = hidden.new_empty(min(chunk, max(M, 1)), V, dtype=torch.float32)  # [chunk, V]
        for start in range(0, M, chunk):
            rows = slice(start, min(start + chunk, M))
            logp = logp_buf[: rows.stop - start]
            lse[rows] = _chunk_logp(hidden[rows].float() / temperature, weight32, logp)
            lp[rows] = logp.gather(1, targets[rows, None]).squeeze(1)
            if with_entropy:
                entropy[rows] = -(torch.exp(logp) * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.set_materialize_grads(False)  # an entropy only logged (detached) reaches backward as None, not zeros
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        M, V = hidden.shape[0], weight.shape[0]
        weight32 = weight.float()
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(weight32) if need_w else None
        use_ent = ctx.with_entropy and g_ent is not None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        buffers = hidden.new_empty(2, min(ctx.chunk, max(M, 1)), V, dtype=torch.float32)  # [2, chunk, V]
        for start in range(0, M, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, M))
            logp, p = buffers[0, : rows.stop - start], buffers[1, : rows.stop - start]
            h_scaled = hidden[rows].float() / ctx.temperature  # [c, H]
            torch.mm(h_scaled, weight32.t(), out=logp).sub_(lse[rows, None])  # [c, V]
            gz = _chunk_grad_logits(logp, p, targets[rows], g_lp[rows], entropy[rows] if use_ent else None,
                                    g_ent[rows].float() if use_ent else None)  # [c, V]
            if need_h:
                torch.mm(gz, weight32, out=grad_h[rows]).div_(ctx.temperature)
            if need_w:
                grad_w.addmm_(gz.t(), h_scaled)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def token_logprobs_chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float = 1.0, with_entropy: bool = False, chunk_size: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked torch head (any device). Same contract as `token_logprobs`."""
    _check(hidden, weight, targets, temperature)
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1])
    lp, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy, int(chunk))
    return lp, (entropy if with_entropy else None)


# ----------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr,
                    PRECISION: tl.constexpr):
        """z [BLOCK_M, BLOCK_V] = hidden[rows] @ weight[cols].T * inv_temp, f32 accumulation.

        DOT_F32 upcasts the tiles first: Triton 3.9's interpreter gets bf16 `tl.dot` wrong.
        PRECISION is "ieee" for f32 inputs (no silent tf32 rounding of log-probs), else "tf32".
        """
        acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
            k_ok = ks < H
            h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        return acc * inv_temp

    @triton.jit
    def _head_fwd_kernel(h_ptr, w_ptr, t_ptr, lp_ptr, lse_ptr, ent_ptr, M, V, H, stride_h, stride_w, inv_temp,
                         WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
        """One block of tokens: online log-sum-exp (and sum p*z) over vocab tiles; no logits stored."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_ok = rows < M
        targets = tl.load(t_ptr + rows, mask=row_ok, other=0)  # [BLOCK_M]
        run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum_v exp(z - run_max)
        run_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum_v exp(z - run_max) * z
        target_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            col_ok = cols < V
            z = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                            BLOCK_M, BLOCK_V, BLOCK_H, DOT_F32, PRECISION)  # [BLOCK_M, BLOCK_V]
            z_safe = tl.where(col_ok[None, :], z, 0.0)
            new_max = tl.maximum(run_max, tl.max(tl.where(col_ok[None, :], z, float("-inf")), axis=1))
            scale = tl.exp(run_max - new_max)  # [BLOCK_M]; exp(-inf) = 0 on the first tile
            e = tl.where(col_ok[None, :], tl.exp(z_safe - new_max[:, None]), 0.0)  # [BLOCK_M, BLOCK_V]
            run_sum = run_sum * scale + tl.sum(e, axis=1)
            if WITH_ENTROPY:
                run_dot = run_dot * scale + tl.sum(e * z_safe, axis=1)
            target_logit += tl.sum(tl.where(cols[None, :] == targets[:, None], z_safe, 0.0), axis=1)
            run_max = new_max
        lse = run_max + tl.log(run_sum)  # [BLOCK_M]
        tl.store(lp_ptr + rows, target_logit - lse, mask=row_ok)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        if WITH_ENTROPY:
            tl.store(ent_ptr + rows, lse - run_dot / run_sum, mask=row_ok)

    @triton.jit
    def _head_bwd_kernel(h_ptr, w_ptr, t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gz_ptr, M, V, H,
                         stride_h, stride_w, stride_gz, inv_temp, WITH_ENTROPY: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
        """One [BLOCK_M, BLOCK_V] tile of gz = d(sum g_lp lp + g_ent ent) / dz for a chunk of tokens."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        row_ok = rows < M
        col_ok = cols < V
        z = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                        BLOCK_M, BLOCK_V, BLOCK_H, DOT_F32, PRECISION)  # [BLOCK_M, BLOCK_V]
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        targets = tl.load(t_ptr + rows, mask=row_ok, other=0)
        logp = z - lse[:, None]
        p = tl.exp(logp)
        gz = tl.where(cols[None, :] == targets[:, None], g_lp[:, None], 0.0) - g_lp[:, None] * p
        if WITH_ENTROPY:
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
            gz -= g_ent[:, None] * p * (logp + ent[:, None])
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(gz_ptr + rows[:, None] * stride_gz + cols[None, :], gz.to(gz_ptr.dtype.element_ty), mask=ok)


def _blocks(hidden: torch.Tensor) -> dict[str, int | bool | str]:
    """Tile sizes and dot options: the smallest tl.dot tiles under the interpreter (CPU), GEMM-sized on GPU."""
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    if hidden.device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_V=32, BLOCK_H=32, DOT_F32=True, PRECISION=precision)
    return dict(BLOCK_M=64, BLOCK_V=64, BLOCK_H=64, DOT_F32=False, PRECISION=precision)


class _TritonTokenLogprobs(torch.autograd.Function):
    """Triton head: fused forward with no logits; chunked backward writing gz [chunk, V] only."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk):
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        (M, H), V = hidden.shape, weight.shape[0]
        lp = hidden.new_empty(M, dtype=torch.float32)  # [M]
        lse, entropy = torch.empty_like(lp), torch.zeros_like(lp)  # [M]
        blocks = _blocks(hidden)
        if M:
            _head_fwd_kernel[(triton.cdiv(M, blocks["BLOCK_M"]),)](
                hidden, weight, targets, lp, lse, entropy, M, V, H, hidden.stride(0), weight.stride(0),
                1.0 / temperature, WITH_ENTROPY=with_entropy, **blocks)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.set_materialize_grads(False)  # an entropy only logged (detached) reaches backward as None, not zeros
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        (M, H), V = hidden.shape, weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[:2]
        use_ent = ctx.with_entropy and g_ent is not None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = g_ent.float().contiguous() if use_ent else g_lp
        # gz in the model's dtype, so the two gradient GEMMs run at its speed; f32 for f32 models.
        gz_dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else torch.float32
        gz = hidden.new_empty(min(ctx.chunk, max(M, 1)), V, dtype=gz_dtype)  # [chunk, V], reused
        w_mm = weight.to(gz_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        blocks = _blocks(hidden)
        for start in range(0, M, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, M))
            count = rows.stop - rows.start
            h = hidden[rows]
            grid = (triton.cdiv(count, blocks["BLOCK_M"]), triton.cdiv(V, blocks["BLOCK_V"]))
            _head_bwd_kernel[grid](
                h, weight, targets[rows], lse[rows], entropy[rows], g_lp[rows], g_ent[rows], gz, count, V, H,
                h.stride(0), weight.stride(0), gz.stride(0), 1.0 / ctx.temperature, WITH_ENTROPY=use_ent, **blocks)
            g = gz[:count]  # [c, V]
            if need_h:
                grad_h[rows] = (g @ w_mm).div_(ctx.temperature).to(hidden.dtype)
            if need_w:
                grad_w += (g.t() @ h.to(gz_dtype)).float().div_(ctx.temperature)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def token_logprobs_triton(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float = 1.0, with_entropy: bool = False, chunk_size: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton head (CUDA, or CPU under TRITON_INTERPRET=1). Same contract as `token_logprobs`."""
    if triton is None:
        raise RuntimeError("token_logprobs_triton: triton is not installed; use token_logprobs_chunked")
    _check(hidden, weight, targets, temperature)
    if hidden.dtype != weight.dtype:  # tl.dot needs one dtype; autograd casts the gradients back
        hidden, weight = hidden.float(), weight.float()
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1])
    if hidden.is_cuda and not chunk_size:
        chunk = max(chunk, GPU_MIN_CHUNK)  # keep the backward GEMMs large enough for tensor cores
    lp, entropy = _TritonTokenLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy, int(chunk))
    return lp, (entropy if with_entropy else None)


# ----------------------------------------------------------------------------- public


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_size: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs f32[M] of `targets` under softmax(hidden @ weight.T / temperature).

    hidden [M, H] (f32 or bf16), weight [V, H] (the LM head), targets i64[M] in [0, V). Returns
    (lp f32[M], entropy f32[M] or None), differentiable w.r.t. hidden and weight; the f32 logits
    [M, V] never exist at once (see `default_chunk_size` for the default `chunk_size`). Triton
    kernels on CUDA; the chunked torch path elsewhere.

    >>> lp, ent = token_logprobs(torch.randn(6, 4), torch.randn(11, 4), torch.arange(6), with_entropy=True)
    """
    impl = token_logprobs_triton if hidden.is_cuda and triton is not None else token_logprobs_chunked
    return impl(hidden, weight, targets, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size)


