"""compressed-tensors pack-quantized INT4: bit order and sign against the layout definition, round trips,
and (when the package is installed) bit-exact agreement with compressed-tensors itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree_serve.model_executor.quantization import Int4Config, PackedWeightAssembler
from ddtree_serve.model_executor.quantization.int4_pack import (
    dequantize_int4,
    pack_int4,
    pack_quantized,
    quantize_int4,
    unpack_int4,
)


def test_bit_layout_is_offset_binary_lsb_first():
    """Value j of a row sits in word j // 8 at bits 4 (j % 8), stored as q + 8."""
    q = torch.arange(-8, 8, dtype=torch.int8)[None]  # [1, 16]: nibbles 0..15
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() == 0x76543210
    assert words[0, 1].item() == 0xFEDCBA98 - (1 << 32)  # the top nibble sets the int32 sign bit
    assert pack_int4(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)).item() == 0x88888889 - (1 << 32)
    assert torch.equal(unpack_int4(words, 16), q)


def test_round_trip_with_padding_and_3d():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 70), generator=g, dtype=torch.int8)  # 70 is not a multiple of 8
    packed = pack_int4(q)
    assert packed.shape == (5, 9)
    assert torch.equal(unpack_int4(packed, 70), q)
    q3 = torch.randint(-8, 8, (3, 4, 64), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q3), 64), q3)
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))


def test_quantize_dequantize_group_32():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    parts = pack_quantized(w, group_size=32)
    assert parts["weight_packed"].shape == (16, 12) and parts["weight_scale"].shape == (16, 3)
    assert parts["weight_scale"].dtype == torch.bfloat16 and parts["weight_shape"].tolist() == [16, 96]
    deq = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], torch.float32)
    q, scale = quantize_int4(w, 32)
    torch.testing.assert_close(deq, (q.float().view(16, 3, 32) * scale.float()[..., None]).view(16, 96))
    err = (deq - w.float()).abs().view(16, 3, 32)
    # round to nearest; the group's absmax maps to +-7.5 and clamps to 7 (+ BF16 rounding of the scale)
    assert bool((err <= scale.float()[..., None] * 0.52).all())


def test_matches_compressed_tensors_package():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (7, 64), generator=g, dtype=torch.int8)
    theirs = helpers.pack_to_int32(q, 4)
    assert torch.equal(pack_int4(q), theirs)
    assert torch.equal(unpack_int4(theirs, 64), helpers.unpack_from_int32(theirs, 4, torch.Size([7, 64])))
    w = torch.randn(8, 64, generator=g).bfloat16()
    ours_q, scale = quantize_int4(w, 32)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    assert torch.equal(quantize(w.float(), scale.float(), None, args, dtype=torch.int8).to(torch.int8), ours_q)
    torch.testing.assert_close(dequantize(ours_q, scale.float(), None, args),
                               dequantize_int4(pack_int4(ours_q), scale, (8, 64), torch.float32))


def test_assembler_any_order_and_incomplete():
    w = torch.randn(4, 32).bfloat16()
    parts = pack_quantized(w)
    asm = PackedWeightAssembler(torch.float32)
    assert asm.feed("m.experts.0.up_proj.weight_shape", parts["weight_shape"]) is None
    assert asm.feed("m.experts.0.up_proj.weight_scale", parts["weight_scale"]) is None
    name, dense = asm.feed("m.experts.0.up_proj.weight_packed", parts["weight_packed"])
    assert name == "m.experts.0.up_proj.weight" and dense.shape == (4, 32)
    asm.finish()
    asm.feed("m.experts.1.up_proj.weight_packed", parts["weight_packed"])
    with pytest.raises(ValueError, match="incomplete"):
        asm.finish()


def test_kimi_quantization_config_targets_routed_experts_only():
    qc = Int4Config.from_hf(json.loads((Path(__file__).resolve().parents[1] / "data" / "kimi-k2.6-config.json").read_text())["quantization_config"])
    assert (qc.group_size, qc.num_bits, qc.symmetric) == (32, 4, True)
    p = "language_model.model.layers.3."
    assert qc.is_quantized(p + "mlp.experts.17.down_proj")
    for name in ("self_attn.kv_b_proj", "mlp.shared_experts.gate_proj", "mlp.gate_proj"):
        assert not qc.is_quantized(p + name)
    assert not qc.is_quantized("lm_head")
    with pytest.raises(ValueError):
        Int4Config.from_hf({"quant_method": "awq"})
