"""The variable-size boundary message: only the positions a microbatch's loss depends on, coded.

Inside a stage a microbatch stays a padded [mb, T, W] tensor (the payload a ``StageModule`` sends: a codec's
message in the model dtype, a mask's K kept values, or the dense hidden state). On the link it is::

    header  int64 [3]: (body bytes, rows n, record bytes w)
    body    uint8 [body bytes]: the n carried positions' records of w bytes, row by row, coded where the
            boundary's codec ends in a coder (``compose.entropy``)

The carried positions of row b are t < length[b], its **carried length**: one past its last labelled
position (``carried_lengths``). Everything after it is padding that no real token attends to (the
attention is causal) and whose logits have no label, so leaving it out changes no loss and no gradient;
the receiver puts zeros there. A row with no label carries nothing. Every stage computes the lengths from
the step's labels itself, so no length travels; the header's n and w let the receiver check that both
sides agree before it decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..boundary.compose.entropy import decode_records, encode_records

__all__ = ["HEADER_VALUES", "WireFormat", "carried_lengths", "carried_mask"]

HEADER_VALUES = 3
IGNORED = -100  # the label of a position without loss (transformers' ignore index)


def carried_lengths(labels: Tensor) -> Tensor:
    """[B] int64: one past each row's last labelled position (0 for a row without labels)."""
    labelled = labels.ne(IGNORED)
    positions = torch.arange(1, labels.shape[-1] + 1, device=labels.device).expand_as(labels)
    return (positions * labelled).amax(-1).to(torch.int64).cpu()


def carried_mask(lengths: Tensor, seq_len: int) -> Tensor:
    """[B, T] bool: position t of row b travels iff t < lengths[b]."""
    return torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(-1)


@dataclass(frozen=True)
class WireFormat:
    """How one direction of one boundary travels: ``record`` bytes per carried position (the first bytes of
    a payload row of ``width`` values of ``dtype``; a codec whose two directions differ in size shares one
    layout, zero-padded), coded by ``coder`` (None: as they are)."""

    record: int
    width: int
    dtype: torch.dtype
    coder: str | None = None

    def pack(self, payload: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        """A [mb, T, width] payload → (header, body) CPU tensors; ``lengths`` None carries every position.
        The header's rows × record is the body's size before coding."""
        rows = payload.detach()
        if lengths is not None:
            rows = rows[carried_mask(lengths, rows.shape[1]).to(rows.device)]
        else:
            rows = rows.reshape(-1, rows.shape[-1])
        records = rows.contiguous().view(torch.uint8)[:, : self.record].cpu()
        body = records.reshape(-1)
        if self.coder is not None:
            body = torch.frombuffer(bytearray(encode_records(records, self.coder)), dtype=torch.uint8)
        header = torch.tensor([body.numel(), records.shape[0], self.record], dtype=torch.int64)
        return header, body

    def expect(self, header: Tensor, lengths: Tensor | None, positions: int) -> int:
        """The body size a received ``header`` announces, once its rows and record size are this side's."""
        size, rows, record = (int(v) for v in header.tolist())
        want = int(lengths.sum()) if lengths is not None else positions
        if rows != want or record != self.record:
            raise ValueError(
                f"boundary message header=(rows {rows}, record {record} B) is invalid: it must announce the "
                f"{want} carried positions of {self.record} B this stage expects (the two sides of the boundary "
                "disagree on the batch or the codec)"
            )
        return size

    def unpack(self, body: Tensor, lengths: Tensor | None, into: Tensor) -> None:
        """Write a received body into the [mb, T, width] buffer ``into``: records at the carried positions,
        zeros elsewhere."""
        rows = int(lengths.sum()) if lengths is not None else into.shape[0] * into.shape[1]
        if self.coder is not None:
            records = decode_records(body.numpy().tobytes(), rows, self.record, self.coder)
        else:
            records = body.reshape(rows, self.record)
        element = into.element_size()
        full = torch.zeros(rows, self.width * element, dtype=torch.uint8)
        full[:, : self.record] = records
        values = full.view(self.dtype).to(into.device)
        with torch.no_grad():
            if lengths is None:
                into.copy_(values.reshape(into.shape))
            else:
                into.zero_()
                into[carried_mask(lengths, into.shape[1]).to(into.device)] = values
