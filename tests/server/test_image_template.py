"""Image prompts as the checkpoint's own chat template renders them (issue 46 item 1): image parts go to the
template as ``{"type": "image"}`` parts, so a template that renders them (Kimi's ``render_content``:
``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` then a newline) gives its own tokens,
newline included; a template that ignores image parts gets the marker in the text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from ddtree_serve.server.http.chat_images import ChatImages
from ddtree_serve.server.http.protocol import ChatCompletionRequest
from ddtree_serve.server.http.serving_chat import _messages
from ddtree_serve.server.multimodal.frontend import IMAGE_MARKER, ImageLimits, PreparedImage, VisionFrontend
from ddtree_serve.server.multimodal.image_processor import ImageProcessorConfig
from ddtree_serve.server.tokenizer_manager import TokenizerManager
from tests.server.kimi_tokenizer_files import CHAT_TEMPLATE, special_token_ids, write_kimi_tokenizer

VOCAB = 512
KIMI_PART = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
# image parts rendered as Kimi's render_content does, and a template that renders them its own other way
RENDERS_KIMI = CHAT_TEMPLATE.replace(
    "{%- for p in m.content if p.type == 'text' -%}{{ p.text }}{%- endfor -%}",
    "{%- for p in m.content -%}{%- if p.type == 'image' -%}" + KIMI_PART.rstrip("\n") + "{{ '\\n' }}"
    "{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}")
RENDERS_OTHER = RENDERS_KIMI.replace("<|media_begin|>image<|media_content|>", "[picture follows] ")


def _tokenizer(tmp_path, template: str):
    write_kimi_tokenizer(tmp_path, VOCAB, media=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)


def _render(tok, body: dict) -> tuple[list[int], ChatImages]:
    req = ChatCompletionRequest.model_validate(body)
    pad = special_token_ids(VOCAB, media=True)["<|media_pad|>"]
    vision = VisionFrontend(ImageProcessorConfig(), pad, ImageLimits(2, 1 << 20, 1 << 24))
    n = sum(len(m.image_urls()) for m in req.messages)
    images = ChatImages(vision, [PreparedImage(None, (1, 4, 6), 6, 1)] * n)
    tm = SimpleNamespace(tokenizer=tok)

    def encode(image_parts: bool, marker: str, video_marker: str = "", splice=None) -> list[int]:
        return TokenizerManager.encode_chat(tm, _messages(req, marker, image_parts, video_marker), None,
                                            {"thinking": False}, splice=splice)

    return images.render(encode), images


BODY = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "text", "text": "what is it?"}]}]}


@pytest.mark.parametrize("template", [RENDERS_KIMI, RENDERS_OTHER], ids=["kimi", "other"])
def test_the_templates_own_rendering_is_the_prompt(tmp_path, template):
    tok = _tokenizer(tmp_path, template)
    ids, images = _render(tok, BODY)
    own = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True, tokenize=False, thinking=False)
    assert ids == tok.encode(own, add_special_tokens=False)
    assert tok.decode(ids).count("\n") == 1  # the newline after <|media_end|>: the token the marker path lacked
    marker = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Look: " + IMAGE_MARKER + "what is it?"}],
                                                add_generation_prompt=True, tokenize=False, thinking=False),
                        add_special_tokens=False)
    assert len(ids) > len(marker)
    expanded, inputs = images.expand(ids)
    assert len(expanded) == len(ids) + 5 and inputs[0].num_tokens == 6


def test_a_template_without_image_parts_gets_the_marker(tmp_path):
    tok = _tokenizer(tmp_path, CHAT_TEMPLATE)  # renders text parts only
    ids, images = _render(tok, BODY)
    assert tok.decode(ids).count("<|media_pad|>") == 1 and "<|media_begin|>image" in tok.decode(ids)
    assert len(images.expand(ids)[0]) == len(ids) + 5
