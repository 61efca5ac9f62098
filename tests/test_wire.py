"""The wire format: signatures, garbled frames, zero-copy tensors."""

from __future__ import annotations

import io
import pickle
import struct

import numpy as np
import pytest
import torch

from meshbook.mesh.wire import BadMessage, Wire, _Pickler, dumps

KEY = b"k" * 32


def roundtrip(value: object) -> object:
    wire = Wire(KEY)
    message = wire.unpack(wire.pack({"k": "test"}, value))
    return message.body()


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
    torch.randn(5, dtype=torch.float64).to(torch.bfloat16),
    torch.tensor([True, False, True]),
    torch.zeros(0, 3),
    torch.tensor(2.5),
    torch.randn(4, dtype=torch.complex64).conj(),
])
def test_tensors_roundtrip_exactly(tensor: torch.Tensor) -> None:
    out = roundtrip({"t": tensor})["t"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor.resolve_conj())


def test_big_tensor_payload_travels_out_of_band() -> None:
    tensor = torch.ones(1 << 20)
    body, buffers = dumps(tensor)
    assert len(body) < 1000 and len(buffers) == 1
    assert memoryview(buffers[0]).nbytes == tensor.numel() * 4


def test_parameter_and_requires_grad_survive() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    leaf = torch.ones(2, requires_grad=True)
    out = roundtrip([param, leaf * 2])
    assert isinstance(out[0], torch.nn.Parameter) and out[0].requires_grad
    assert out[1].requires_grad and out[1].grad_fn is None


def test_received_tensor_is_writable() -> None:
    out = roundtrip(torch.zeros(1 << 16))
    out.add_(1)
    assert out.sum().item() == 1 << 16


def test_in_band_pickle_never_aliases_bytes() -> None:
    out = io.BytesIO()
    _Pickler(out, protocol=5).dump(torch.arange(4.0))  # no buffer_callback: buffers in-band
    again = pickle.loads(out.getvalue())
    again.add_(1)
    assert torch.equal(again, torch.arange(4.0) + 1)


def test_numpy_arrays_roundtrip() -> None:
    array = np.arange(10.0)
    assert np.array_equal(roundtrip(array), array)


def swap_header(envelope: bytes) -> bytes:
    evil = pickle.dumps({"k": "exec", "evil": 1})
    return envelope[:32] + struct.pack("<I", len(evil)) + evil


@pytest.mark.parametrize("mangle", [
    lambda f: [b"0" * 32 + f[0][32:], *f[1:]],  # forged signature
    lambda f: [f[0][:20]],  # truncated
    lambda f: [],  # nothing at all
    lambda f: [f[0] + b"x", *f[1:]],  # body changed after signing
    lambda f: [swap_header(f[0]), *f[1:]],  # header swapped
    lambda f: [f[0], b"an extra buffer"],  # a buffer smuggled in
    lambda f: [b"\xff" * 40, b"\x00", b"", b"garbage"],
])
def test_tampered_messages_are_rejected_and_counted(mangle) -> None:
    wire = Wire(KEY)
    frames = [bytes(memoryview(f)) for f in wire.pack({"k": "exec"}, {"code": "1"})]
    with pytest.raises(BadMessage):
        wire.unpack(mangle(frames))
    assert wire.dropped == 1


def test_another_key_cannot_sign() -> None:
    frames = Wire(b"x" * 32).pack({"k": "exec"}, {"code": "1"})
    with pytest.raises(BadMessage, match="bad signature"):
        Wire(KEY).unpack(frames)
