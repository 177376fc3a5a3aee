"""The grammar of a forced tool call (ddtree_serve/server/parsers/tool_grammar.py), compiled by xgrammar over the default
model's tokenizer: it accepts the calls of each parser's format that the tools' schemas allow, rejects
the others, and every token path a matcher lets through ends as calls that the tool-call parser reads back
and that validate against their schemas."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest
import torch
import xgrammar as xgr

from ddtree_serve.server.parsers import parse_tool_calls
from ddtree_serve.server.parsers.tool_grammar import ToolGrammarError, prefix_rules, tool_call_ebnf

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]}
TOOLS = [("get_weather", WEATHER), ("add", ADD), ("now", None), ("lookup", CODE)]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {},
                                                        "additionalProperties": False}, "lookup": CODE}


def kimi(*calls: tuple[str, str]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
                   for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def hermes(*calls: tuple[str, str]) -> str:
    return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)


FORMATS = {"kimi_k2": kimi, "hermes": hermes}
VALID = [(("get_weather", '{"city": "Paris", "unit": "c"}'),), (("add", '{"a": 2, "b": -40}'),),
         (("now", "{}"),), (("lookup", '{"code": "ABC"}'),),
         (("get_weather", '{"city": "Oslo"}'), ("now", "{}"), ("add", '{"a": 0, "b": 1}'))]
INVALID = [(("get_weather", '{"unit": "c"}'),),  # a required property missing
           (("get_weather", '{"city": "Paris", "unit": "k"}'),),  # not in the enum
           (("add", '{"a": 2, "b": "3"}'),),  # wrong type
           (("add", '{"a": 2, "b": 3, "c": 4}'),),  # a property the schema does not have
           (("now", '{"x": 1}'),),  # no parameters: {} only
           (("lookup", '{"code": "abc"}'),),  # the pattern
           (("send_mail", "{}"),)]  # not a tool


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ddtree_serve.model_executor.default_model import default_model_dir, ensure_default_model

    ensure_default_model()
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def _matches(compiler, tokenizer, ebnf: str, text: str) -> bool:
    """``text`` is a complete sentence of the grammar (the model could then end with EOS)."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf)))
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_required_accepts_valid_calls_and_rejects_others(parser, compiler, tokenizer) -> None:
    ebnf = tool_call_ebnf(parser, TOOLS)
    fmt = FORMATS[parser]
    for calls in VALID:
        text = fmt(*calls)
        assert _matches(compiler, tokenizer, ebnf, text), text
        _, parsed = parse_tool_calls(parser, text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(n, json.loads(a)) for n, a in calls]
    for calls in INVALID:
        assert not _matches(compiler, tokenizer, ebnf, fmt(*calls)), calls
    ok = fmt(*VALID[0])
    assert not _matches(compiler, tokenizer, ebnf, "Sure! " + ok)  # nothing before the calls
    assert not _matches(compiler, tokenizer, ebnf, ok + " done")  # nor after them
    assert not _matches(compiler, tokenizer, ebnf, "")  # "required": at least one call
    assert not _matches(compiler, tokenizer, ebnf, ok[:-3])  # an unfinished call cannot end


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_required_without_parallel_calls_allows_exactly_one(parser, compiler, tokenizer) -> None:
    ebnf = tool_call_ebnf(parser, TOOLS, parallel=False)
    fmt = FORMATS[parser]
    for calls in VALID[:4]:
        assert _matches(compiler, tokenizer, ebnf, fmt(*calls)), calls
    assert not _matches(compiler, tokenizer, ebnf, fmt(*VALID[4]))  # three calls


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_named_tool_allows_exactly_one_call_of_it(parser, compiler, tokenizer) -> None:
    ebnf = tool_call_ebnf(parser, TOOLS, named="add")
    fmt = FORMATS[parser]
    assert _matches(compiler, tokenizer, ebnf, fmt(("add", '{"a": 1, "b": 2}')))
    assert not _matches(compiler, tokenizer, ebnf, fmt(("now", "{}")))
    assert not _matches(compiler, tokenizer, ebnf, fmt(("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')))
    assert "get_weather" not in ebnf and "t0_" not in ebnf  # only the named tool's rules


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_every_path_the_matcher_allows_ends_as_valid_calls(parser, compiler, tokenizer) -> None:
    """Random walks over the token masks (uniform among allowed tokens, fixed seeds): each finished walk
    decodes to calls the parser reads back, of known tools, with arguments valid under their schemas."""
    tools = [("add", ADD), ("now", None), ("pick", {"type": "object", "properties": {
        "flag": {"type": "boolean"}, "unit": {"enum": ["c", "f"]}}, "required": ["flag", "unit"]})]
    schemas = {"add": ADD, "now": SCHEMAS["now"], "pick": tools[2][1]}
    compiled = compiler.compile_grammar(xgr.Grammar.from_ebnf(tool_call_ebnf(parser, tools)))
    vocab = compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    finished = 0
    for seed in range(12):
        rng, matcher, ids = random.Random(seed), xgr.GrammarMatcher(compiled), []
        for _ in range(300):
            matcher.fill_next_token_bitmask(bitmask)
            bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
            allowed = bits.flatten()[:vocab].nonzero().flatten().tolist()
            assert allowed, "the grammar left no token"
            tok = rng.choice(allowed)
            if tok == tokenizer.eos_token_id:
                break
            assert matcher.accept_token(tok)
            ids.append(tok)
        else:
            continue  # a long walk (integers can grow): not finished, nothing to check
        finished += 1
        text = tokenizer.decode(ids)
        rest, calls = parse_tool_calls(parser, text)
        assert rest == "" and calls, text
        for call in calls:
            assert jsonschema_rs.is_valid(schemas[call.name], json.loads(call.arguments)), text
    assert finished >= 6


def test_named_or_listed_tools_are_checked() -> None:
    with pytest.raises(ToolGrammarError, match="not in 'tools'") as e:
        tool_call_ebnf("hermes", TOOLS, named="send_mail")
    assert e.value.index == -1
    with pytest.raises(ToolGrammarError, match=r"tools\[1\].function.name") as e:
        tool_call_ebnf("kimi_k2", [("ok", None), ("bad name:1", None)])
    assert e.value.index == 1
    with pytest.raises(ToolGrammarError, match=r"tools\[0\].function.parameters.*Unsupported type") as e:
        tool_call_ebnf("hermes", [("f", {"type": "nonsense"})])
    assert e.value.index == 0 and "/project/" not in str(e.value)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_ebnf("mistral", TOOLS)


def test_prefix_rules_renames_rules_only() -> None:
    ebnf = 'root ::= "root [x] \\"a\\"" item [a-z\\]] Regex("^[a-z]+$", json_string=true) item{1, -1}\nitem ::= "i"\n'
    renamed = prefix_rules(ebnf, "t7_")
    assert renamed == ('t7_root ::= "root [x] \\"a\\"" t7_item [a-z\\]] Regex("^[a-z]+$", json_string=true) '
                       't7_item{1, -1}\nt7_item ::= "i"\n')


def test_kimi_grammar_takes_kimi_special_tokens(tmp_path) -> None:
    """On a Kimi-style tiktoken tokenizer (our stand-in) the section and call markers are single special
    tokens: the kimi_k2 grammar accepts a call written with them, token by token, and nothing else first."""
    from transformers import AutoTokenizer

    from tests.server.kimi_tokenizer_files import write_kimi_tokenizer

    write_kimi_tokenizer(tmp_path, 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(tool_call_ebnf("kimi_k2", TOOLS)))
    ids = tok.encode(kimi(("get_weather", '{"city": "Paris"}'), ("now", "{}")))
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|tool_calls_section_begin|>", "<|tool_call_begin|>"]
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(i) for i in ids)
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()
    assert not xgr.GrammarMatcher(compiled).accept_token(tok.encode("Sure")[0])
