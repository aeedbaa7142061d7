"""One query tile of the Triton attention kernels: its rows, one online-softmax step, its output.

Both attention kernels (:mod:`.paged_attention` for the token-wise formats, :mod:`.sealed_attention` for
``int4``/``int2``) run one program per (work item, kv head, context split); a work item is a tile of up to
``BLOCK_Q`` consecutive queries of one request, and the tile's ``BLOCK_M`` rows are query ``t`` x head ``g`` of
the kv head's GQA group (row ``r``: ``t = r // GROUP``, ``g = r % GROUP``). They differ only in how a tile of
keys and values is found and decoded; what is around it lives here:

* :func:`query_tile` reads the work item and loads the tile's queries;
* :func:`online_softmax_step` folds one ``[BLOCK_M, BLOCK_N]`` score tile and its values into the running
  maximum, sum and accumulator (Milakov & Gimelshein 2018; FlashAttention-2's ordering, Dao 2023);
* :func:`store_tile` writes the normalised output, or for a split context the partial output and its
  log-sum-exp for the merge kernel (flash-decoding).

Imports triton; loaded lazily by :mod:`kvpage.ops.backends.triton`.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def query_tile(q_ptr, items_ptr, seq_lens_ptr, qstart_ptr, num_heads, head_dim,
               GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's work item and its queries.

    ``items_ptr`` holds ``(request, first query within the request)`` int64 pairs; the grid's axis 0 picks one
    and axis 1 the kv head. Returns ``(req, q0, seq_len, n, row_ok, qrow, qpos, d, dm, q)``: the request, the
    tile's first query, the request's context length and new tokens, which of the ``BLOCK_M`` rows are real
    queries, each row's index in ``[tokens * num_heads]``, each row's position in its context, the channel
    indices ``[BLOCK_D]`` and their mask, and the queries ``[BLOCK_M, BLOCK_D]`` (0 outside the masks, in
    ``q_ptr``'s dtype).
    """
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(items_ptr + 2 * item)
    q0 = tl.load(items_ptr + 2 * item + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    qa = tl.load(qstart_ptr + req)
    n = tl.load(qstart_ptr + req + 1) - qa
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP
    row_ok = (t < BLOCK_Q) & (q0 + t < n)
    tok = (qa + q0 + t).to(tl.int64)
    head = kvh * GROUP + r % GROUP
    qpos = seq_len - n + q0 + t
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    qrow = tok * num_heads + head
    q = tl.load(q_ptr + qrow[:, None] * head_dim + d[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)
    return req, q0, seq_len, n, row_ok, qrow, qpos, d, dm, q


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc):
    """Fold scores ``s`` ``[BLOCK_M, BLOCK_N]`` (``-inf`` where masked) and values ``v`` ``[BLOCK_N, BLOCK_D]``
    into the running maximum ``m_i``, sum ``l_i`` ``[BLOCK_M]`` and accumulator ``acc`` ``[BLOCK_M, BLOCK_D]``
    (float32); returns the three updated. A row with no visible key yet keeps ``-inf``, 0 and 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def store_tile(out_ptr, lse_ptr, acc, m_i, l_i, qrow, row_ok, d, dm, num_tokens, num_heads, head_dim,
               SPLIT: tl.constexpr):
    """Write the tile's rows ``acc / l_i`` (a row that saw no key: 0) to ``out_ptr`` ``[tokens * heads,
    head_dim]``; with ``SPLIT``, to split ``program_id(2)``'s slice of the partial outputs ``[splits, tokens *
    heads, head_dim]`` with the rows' log-sum-exp (``-inf`` for none) in ``lse_ptr`` ``[splits, tokens *
    heads]``. Side effect: those stores only."""
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    omask = row_ok[:, None] & dm[None, :]
    if SPLIT:
        part = tl.program_id(2).to(tl.int64) * num_tokens * num_heads + qrow
        tl.store(out_ptr + part[:, None] * head_dim + d[None, :], o, mask=omask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + part, lse, mask=row_ok)
    else:
        tl.store(out_ptr + qrow[:, None] * head_dim + d[None, :], o, mask=omask)
