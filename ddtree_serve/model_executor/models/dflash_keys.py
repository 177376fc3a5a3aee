"""Drafter config keys that change a DFlash drafter's math and that this project does not implement
(docs/DESIGN.md 4.5): a drafter declaring one is refused, naming the key, rather than run as another model.

Sources of the keys: github z-lab/dflash ``dflash/model.py`` (``compute_logits``: ``output_multiplier`` and
``final_logit_softcapping``; ``dflash_generate``: ``input_embedding_scale``; ``DFlash2DraftModel``'s candidate
selector: ``selector_rank``/``selector_top_k``, refused by ``dflash_conv.check_no_candidate_selector`` with its
own reason) and sgl-project/SpecForge ``specforge/modeling/draft/dflash.py`` (``dflash_config.attention_mode`` /
``attention_modes``: ``mla`` latent-attention and ``kda`` linear-attention drafter layers). Each key is read from
``dflash_config`` first, then the top level, as z-lab's ``_draft_value`` does. Layer types other than sliding and
full attention are refused by ``dflash_window.layer_attention``.
"""

from __future__ import annotations

from typing import Any

_ABSENT = object()
# key -> the value that leaves the math unchanged (None: absent, null or <= 0 is neutral, as z-lab's softcap test)
_NEUTRAL: dict[str, Any] = {"output_multiplier": 1.0, "input_embedding_scale": 1.0, "final_logit_softcapping": None}
_ATTENTION_MODES = ("gqa", "mha")  # SpecForge's names of the (grouped-query) attention implemented here


def _value(hf: dict[str, Any], key: str) -> Any:
    dcfg = hf.get("dflash_config") or {}
    return dcfg[key] if key in dcfg else hf.get(key, _ABSENT)


def unimplemented_keys(hf: dict[str, Any]) -> list[str]:
    """``key=value`` for every math-changing key of the drafter config ``hf`` that is not implemented."""
    out = []
    for key, neutral in _NEUTRAL.items():
        v = _value(hf, key)
        if v is _ABSENT or v is None:
            continue
        if neutral is None and float(v) <= 0:
            continue
        if neutral is not None and float(v) == neutral:
            continue
        out.append(f"{key}={v!r}")
    mode = _value(hf, "attention_mode")
    if mode is not _ABSENT and str(mode).lower() not in _ATTENTION_MODES:
        out.append(f"attention_mode={mode!r}")
    modes = _value(hf, "attention_modes")
    if modes is not _ABSENT and any(str(m).lower() not in _ATTENTION_MODES for m in modes or ()):
        out.append(f"attention_modes={modes!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act!r}")
    return out


def check_implemented(hf: dict[str, Any], what: str) -> None:
    """ValueError naming every unimplemented math-changing key of ``what``'s config ``hf``."""
    bad = unimplemented_keys(hf)
    if bad:
        raise ValueError(f"{what} declares {', '.join(bad)}, which change(s) the drafter's math and is not "
                         "implemented here; refusing rather than running a different model (docs/DESIGN.md 4.5)")
