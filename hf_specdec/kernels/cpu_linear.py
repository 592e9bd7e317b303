"""CPU GEMM forms of a linear layer over a few rows: tensors in, tensors out.

Verifying a draft tree multiplies every weight matrix by ``n + 1`` rows instead of one. For one to three rows MKL
runs a matrix-vector kernel that streams the weights once; from four rows on it runs a GEMM that first *re-packs*
the weight matrix into its blocked layout on every call. The forms here compute the same ``x @ W.T + b`` three ways:

- ``"linear"``: `F.linear` (stock),
- ``"weight_major"``: ``W @ x.T``: the big matrix as GEMM's A operand, streamed once without re-packing,
- ``"packed"``: ``torch.ops.mkl._mkl_linear`` on a copy of the weight packed once with MKL's ``cblas_sgemm_pack``
  (`pack_weight`),
- ``"few_rows"``: `few_rows_gemm.linear`, a kernel compiled on this machine, on a copy of the weight packed in
  panels once (`few_rows_gemm.pack_weight`), reading it once for all rows (where `few_rows_gemm` was built or loaded:
  `available_forms`).

Same math, same fp32 precision; only the blocking of the sums may differ, as it already does between a 1-row and an
n-row forward. Which form runs where, when weights are packed and how modules use them is policy
(``generation/packed_linears.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import few_rows_gemm

GEMM_FORMS = ("packed", "linear", "weight_major", "few_rows")
MIN_PACKED_ROWS = 4  # below this MKL's matrix-vector path is as fast as its packed GEMM (measured; docs/lab/measurements.md)


def available() -> bool:
    """Whether this torch build has MKL's packed linear ops."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


def available_forms(can_copy: bool, rows: int = MIN_PACKED_ROWS) -> tuple[str, ...]:
    """The forms this process can run over ``rows`` rows: those on the weight as it is, and where packed copies are
    allowed (``can_copy``) one form on a copy: "few_rows" where its kernel is loaded (a copy the weight's size),
    else "packed" from `MIN_PACKED_ROWS` rows where MKL has it (3.35x the weight's size). One copy form, so a
    weight never holds two copies whatever row counts its layer meets."""
    few_rows = can_copy and few_rows_gemm.loaded()
    packed = can_copy and rows >= MIN_PACKED_ROWS and available() and not few_rows
    return tuple(f for f in GEMM_FORMS if (f != "packed" or packed) and (f != "few_rows" or few_rows))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL-packed copy of the `[out, in]` fp32 ``weight`` (the ``"packed"`` form's operand)."""
    with torch.no_grad():
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 64)


def gemm(
    form: str,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[rows, out]` = ``x2`` `[rows, in]` times ``weight`` `[out, in]` transposed (+ ``bias``), computed as ``form``
    (``packed``: `pack_weight` of ``weight`` for the ``"packed"`` form, `few_rows_gemm.pack_weight` of it for
    ``"few_rows"``)."""
    if form == "linear":
        return F.linear(x2, weight, bias)
    if form == "weight_major":
        y = torch.mm(weight, x2.t()).t().contiguous()  # row-major like F.linear's: layers may view() it
        return y if bias is None else y + bias
    if form == "few_rows" and packed is not None:
        return few_rows_gemm.linear(x2, packed, weight.shape[0], bias)
    if form != "packed" or packed is None:
        raise ValueError(
            f"GEMM form {form!r}: expected one of {GEMM_FORMS} (and the packed weight for 'packed' and 'few_rows')"
        )
    return torch.ops.mkl._mkl_linear(x2, packed, weight, bias, x2.shape[0])
