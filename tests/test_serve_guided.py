"""``vkformers serve``'s vLLM guided decoding options through the ``openai`` client's ``extra_body``: guided_regex,
guided_choice, guided_json (with guided_whitespace_pattern) and guided_grammar (GBNF and Lark), and the newer
``structured_outputs`` object with the same constraints and its JSON settings; on /v1/chat/completions and
/v1/completions, streamed equal to whole. A regex, grammar, choice list or schema the engine cannot take is a 400
naming the field and the server goes on; two constraints at once are a 400 naming both. On the tiny random GGUF
llama of test_serve (byte-level BPE, a chat template)."""
from __future__ import annotations

import json
import re

import pytest
from structured_checks import PERSON, blank_tokens, schema_errors
from test_serve import SERVED, error_of, request
from test_serve_structured import grammar_server, openai

MESSAGES = [{"role": "user", "content": "answer"}]
EMAIL = r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)"
# vLLM's example of guided_grammar, in GBNF (as xgrammar and llama.cpp read it): a finite language, here its regex
SQL_GBNF = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
SQL = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
GREETING_LARK = """start: greeting " " NAME "!"
greeting: "hi" | "hello"
NAME: /[a-z]{1,5}/
"""
GREETING = r"(hi|hello) [a-z]{1,5}!"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with grammar_server(tmp_path_factory.mktemp("guided")) as served:
        tokenizer = served["tokenizer"]
        # (a space or a tab alone: where the grammar lets in whitespace, the output takes one)
        spaced = {str(t): 100 for t in blank_tokens(tokenizer) if tokenizer.decode([t]) in (" ", "\t")}
        yield {**served, "spaced": spaced}


def chat(server, extra_body, **options):
    """The chat completion's text, greedy, and the same streamed (which must be equal); and its finish reason."""
    client, options = server["client"], {"model": SERVED, "messages": MESSAGES, "temperature": 0,
                                             "max_tokens": 60, "extra_body": extra_body, **options}
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(stream=True, **options))
    text = whole.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    return text, whole.choices[0].finish_reason


def complete(server, extra_body, **options):
    """The same on /v1/completions."""
    client, options = server["client"], {"model": SERVED, "prompt": "the answer is", "temperature": 0,
                                             "max_tokens": 60, "extra_body": extra_body, **options}
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(stream=True, **options))
    text = whole.choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    return text, whole.choices[0].finish_reason


@pytest.mark.parametrize("send", [chat, complete])
@pytest.mark.parametrize("form", ["guided", "structured_outputs"])
def test_a_regex_keeps_the_output_to_its_matches(server, send, form):
    extra = {"guided_regex": EMAIL} if form == "guided" else {"structured_outputs": {"regex": EMAIL}}
    text, reason = send(server, extra)
    assert re.fullmatch(EMAIL, text) and reason == "stop", text


def test_without_a_constraint_the_outputs_would_not_match(server):
    """(So the tests above and below see the constraint at work, not the tiny model's own answer.)"""
    free = server["client"].chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0, max_tokens=12)
    text = free.choices[0].message.content
    assert not re.fullmatch(EMAIL, text) and not re.fullmatch(SQL, text) and not re.fullmatch(GREETING, text)


@pytest.mark.parametrize("send", [chat, complete])
def test_choices_each_output_is_exactly_one_of_them_greedy_and_seeded(server, send):
    choices = ['say "yes"', "no", "maybe later", "é ü"]
    text, reason = send(server, {"guided_choice": choices})
    assert text in choices and reason == "stop"
    client = server["client"]
    outputs = set()
    for seed in range(4):
        if send is chat:
            response = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=1.0, seed=seed, n=3,
                                                      extra_body={"structured_outputs": {"choice": choices}})
            texts = [c.message.content for c in response.choices]
        else:
            response = client.completions.create(model=SERVED, prompt="pick", temperature=1.0, seed=seed, n=3,
                                                 max_tokens=20, extra_body={"structured_outputs": {"choice": choices}})
            texts = [c.text for c in response.choices]
        assert all(t in choices for t in texts), texts
        outputs.update(texts)
    assert len(outputs) >= 2  # sampled among the choices, not one forced answer


@pytest.mark.parametrize("send", [chat, complete])
def test_a_gbnf_grammar_and_a_lark_grammar_keep_the_output_to_their_language(server, send):
    text, reason = send(server, {"guided_grammar": SQL_GBNF})
    assert re.fullmatch(SQL, text) and reason == "stop", text
    text, reason = send(server, {"structured_outputs": {"grammar": GREETING_LARK}})
    assert re.fullmatch(GREETING, text) and reason == "stop", text


@pytest.mark.parametrize("as_text", [False, True])
def test_guided_json_validates_against_the_schema(server, as_text):
    schema = json.dumps(PERSON) if as_text else PERSON
    for send in (chat, complete):
        text, reason = send(server, {"guided_json": schema}, logit_bias=server["compact"], max_tokens=100)
        assert reason == "stop" and schema_errors(json.loads(text), PERSON) == [], text
    text, _ = chat(server, {"structured_outputs": {"json": schema}}, logit_bias=server["compact"], max_tokens=100)
    assert schema_errors(json.loads(text), PERSON) == [], text


def test_json_whitespace_settings(server):
    """With a space and a tab favoured, the default pattern lets spaces in; guided_whitespace_pattern
    allows only its own (tabs), disable_any_whitespace none; disable_additional_properties closes the objects a
    schema leaves open."""
    strings = re.compile(r'"(?:[^"\\]|\\.)*"')

    def blanks(text):  # the whitespace between JSON tokens
        return set(re.sub(r"\S", "", strings.sub("", text)))
    options = dict(logit_bias=server["spaced"], max_tokens=100)
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer",
                                                                                      "maximum": 9}},
              "required": ["pet", "age"], "additionalProperties": False}
    free, _ = chat(server, {"guided_json": schema}, **options)
    assert blanks(free) == {" "} and schema_errors(json.loads(free), schema) == [], free
    tabs, _ = chat(server, {"guided_json": schema, "guided_whitespace_pattern": r"\t?"}, **options)
    assert blanks(tabs) == {"\t"} and schema_errors(json.loads(tabs), schema) == [], tabs
    none, reason = chat(server, {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, **options)
    assert blanks(none) == set() and reason == "stop" and schema_errors(json.loads(none), schema) == [], none
    # an object the schema leaves open, a comma and quotes favoured: another property (an empty key) follows, unless
    # the object is closed
    open_schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
                   "maxProperties": 2}
    convert = server["tokenizer"].convert_tokens_to_ids
    favoured = {str(convert(",")): 50, str(convert('"')): 100}
    for closed in (False, True):
        text, reason = chat(server, {"structured_outputs": {"json": open_schema, "disable_any_whitespace": True,
                                                            "disable_additional_properties": closed}},
                            logit_bias=favoured, max_tokens=100)
        value = json.loads(text)
        assert reason == "stop" and "pet" in value and len(value) == (1 if closed else 2), text
    obj, _ = chat(server, {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
                  max_tokens=100)
    assert isinstance(json.loads(obj), dict) and blanks(obj) == set(), obj


def test_options_of_other_engines_are_taken_and_do_nothing(server):
    """guided_decoding_backend (vLLM's choice of engine) and disable_fallback: llguidance keeps the output to the
    constraint all the same."""
    text, _ = chat(server, {"guided_regex": EMAIL, "guided_decoding_backend": "xgrammar:no-fallback"})
    assert re.fullmatch(EMAIL, text)
    text, _ = complete(server, {"structured_outputs": {"choice": ["no", "yes"], "disable_fallback": True}})
    assert text in ("no", "yes")


BAD = [({"guided_regex": "(("}, "guided_regex", "unclosed group"),
       ({"guided_regex": "a(?=b)"}, "guided_regex", "look-around"),
       ({"structured_outputs": {"regex": ["a"]}}, "structured_outputs.regex", "must be a string"),
       ({"guided_grammar": 'root ::= "a" undefined'}, "guided_grammar", "undefined"),
       ({"guided_grammar": "start: missing"}, "guided_grammar", "unknown name"),
       ({"guided_choice": []}, "guided_choice", "non-empty list"), ({"guided_choice": ["a", 1]}, "guided_choice", ""),
       ({"guided_json": "{not json"}, "guided_json", "JSON text"),
       ({"guided_json": {"type": "nothing"}}, "guided_json", "Invalid type"),
       ({"guided_json": PERSON, "guided_whitespace_pattern": "(("}, "guided_json", "unclosed group"),
       ({"guided_whitespace_pattern": 3, "guided_json": PERSON}, "guided_whitespace_pattern", ""),
       ({"guided_decoding_backend": 1}, "guided_decoding_backend", ""),
       ({"structured_outputs": "regex"}, "structured_outputs", ""),
       ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "'regexp'"),
       ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": "yes"}}, "structured_outputs", ""),
       ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
       ({"structural_tag": "{}"}, "structural_tag", "not supported")]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_what_the_engine_cannot_take_is_a_one_line_400_and_the_server_goes_on(server, route):
    base = {"model": SERVED, "max_tokens": 4, **({"messages": MESSAGES} if "chat" in route else {"prompt": "hi"})}
    for extra, param, words in BAD:
        status, error = error_of(request(server, "POST", route, {**base, **extra}))
        assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (extra, error)
        assert words in error["message"] and "\n" not in error["message"], (extra, error)
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        server["client"].chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4,
                                                 extra_body={"guided_regex": "(("})
    text, _ = chat(server, {"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, text) and server["scheduler"].error is None


def test_two_constraints_at_once_are_a_400_naming_both(server):
    base = {"model": SERVED, "messages": MESSAGES, "max_tokens": 4}
    pairs = [({"response_format": {"type": "json_object"}, "guided_regex": "a"},
              ("'response_format'", "'guided_regex'")),
             ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
              ("'guided_choice'", "'structured_outputs.regex'")),
             ({"guided_json": PERSON, "guided_grammar": SQL_GBNF}, ("'guided_json'", "'guided_grammar'")),
             ({"structured_outputs": {"json_object": True, "choice": ["a"]}},
              ("'structured_outputs.choice'", "'structured_outputs.json_object'"))]
    for extra, names in pairs:
        status, error = error_of(request(server, "POST", "/v1/chat/completions", {**base, **extra}))
        assert status == 400 and all(name in error["message"] for name in names), (extra, error)
    with pytest.raises(openai.BadRequestError, match="each constrain the output"):
        server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=4,
                                            extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    # a text response_format and an off json_object constrain nothing: the one constraint is kept
    text, _ = chat(server, {"response_format": {"type": "text"}, "structured_outputs": {"regex": EMAIL,
                                                                                       "json_object": False}})
    assert re.fullmatch(EMAIL, text)
