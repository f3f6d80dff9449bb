"""Every registered model_type spelling offers exactly the task heads transformers has for it
(tests/fixtures/transformers_heads.json, written by tools/write_head_table.py from transformers 5.24's
MODEL_FOR_<TASK>_MAPPING_NAMES), with transformers' parameter names and base-model prefix, but for the heads listed
in MISSING with the reason; a head transformers lacks is refused in one line naming the heads there are."""
import json
from pathlib import Path

import pytest

import vkformers
from vkformers.models.heads import HEAD_MODELS, SequenceHead, TaskHeadError, TaskHeads, Transform, offered_tasks
from vkformers.models.loading import plugin_manager, registry

TABLE = json.loads((Path(__file__).parent / "fixtures" / "transformers_heads.json").read_text())
HEADS = TABLE["heads"]
SEQ, TOKEN, QA, CHOICE = HEAD_MODELS  # the task names, in HEAD_MODELS order
NO_BASE = "no base model (AutoModel) in vkformers for this architecture yet, so no head on it"
WRAPPER = ("a multimodal wrapper's head: the loader keeps only a wrapper checkpoint's language-model weights, so "
           "the head's would start fresh; not declared")
# Heads transformers has that vkformers does not offer (yet): spelling -> {task: why}
MISSING = {
    "big_bird": {QA: "BigBirdForQuestionAnswering's qa_classifier (dense, LayerNorm, projection, question mask) is "
                     "not declared", CHOICE: "BigBird's pooler is not built (its heads read the first token)"},
    "bigbird_pegasus": {SEQ: "not declared yet (BART's eos head; no fixture case)",
                        QA: "not declared yet (BART's qa_outputs; no fixture case)"},
    "jina_embeddings_v3": dict.fromkeys((SEQ, TOKEN, QA), "not declared yet: its base runs one LoRA task adapter, "
                                                          "which the heads would have to choose"),
    "led": {QA: "not declared yet (qa_outputs on the decoder states; no fixture case)"},
    "t5gemma": dict.fromkeys((SEQ, TOKEN), "T5Gemma's score.out_proj heads (on the decoder's or the encoder's "
                                           "states, by is_encoder_decoder) are not declared"),
    "t5gemma2": dict.fromkeys((SEQ, TOKEN), "T5Gemma 2's score.out_proj heads are not declared"),
    **{name: dict.fromkeys(tasks, NO_BASE) for name, tasks in {
        "jamba": (SEQ,), "minimax": (SEQ, TOKEN, QA), "zamba": (SEQ,),
        "zamba2": (SEQ,)}.items()},
    **{name: dict.fromkeys(tasks, WRAPPER) for name, tasks in {
        "gemma3": (SEQ,), "qwen3_5": (SEQ, TOKEN), "modernvbert": (SEQ, TOKEN), "qwen3_asr": (TOKEN,)}.items()},
}
CONFIG = {"hidden_size": 16}  # what a declaration reads of the config (DeBERTa's pooler width)


def base_classes(spelling):
    """The base-model classes the spelling can run on: its architecture's, or every family's for a wrapper (its
    backbone is named by the nested config)."""
    alias = next((a for a in registry().aliases() if a.spelling == spelling), None)
    names = [a.name for a in registry().architectures()] if alias is not None and alias.is_wrapper else \
        [alias.target if alias is not None else spelling]
    found = (plugin_manager().hook.vkformers_model_class(architecture=registry().get(name), task="base")
             for name in names)
    return {cls for cls in found if cls is not None}


def declared(spelling) -> TaskHeads | None:
    """The spelling's heads, as the head models ask for them; a wrapper's from whichever base declares them."""
    found = [heads for cls in base_classes(spelling)
             if (heads := cls.task_heads(dict(CONFIG, model_type=spelling), spelling)) is not None]
    assert len(found) <= 1, f"{spelling}: heads declared by more than one base class"
    return found[0] if found else None


def test_table_covers_every_registered_spelling():
    assert TABLE["transformers"] == "5.24.0"
    assert sorted(HEADS) == registry().spellings(), "regenerate: python tools/write_head_table.py"


def test_offered_heads_are_those_transformers_has():
    wrong = []
    for spelling in registry().spellings():
        offered, has = set(offered_tasks(declared(spelling))), set(HEADS[spelling])
        missing = set(MISSING.get(spelling, ()))
        assert missing <= has - offered, f"{spelling}: MISSING lists {sorted(missing - (has - offered))}"
        if offered - has:
            wrong.append(f"{spelling}: offers {sorted(offered - has)}, which transformers lacks")
        if has - offered - missing:
            wrong.append(f"{spelling}: lacks {sorted(has - offered - missing)}, neither offered nor in MISSING")
    assert not wrong, "\n".join(wrong)


def linear(path, bias):
    return {f"{path}.weight"} | ({f"{path}.bias"} if bias else set())


def sequence_parameters(head: SequenceHead):
    names = linear(head.out, head.out_bias)
    if head.dense:
        names |= linear(head.dense, head.dense_bias)
    if head.dense_norm:
        names |= linear(head.dense_norm, head.norm_bias)
    return names


def transform_parameters(transform: Transform | None):
    if transform is None:
        return set()
    return linear(transform.dense, transform.bias) | (linear(transform.norm, transform.norm_bias)
                                                       if transform.norm else set())


def head_parameters(heads: TaskHeads, task):
    """The parameter names the declared head adds to its base (a pooler belongs to the base)."""
    if task in (SEQ, CHOICE):
        return sequence_parameters(heads.sequence if task == SEQ else heads.multiple_choice)
    if task == TOKEN:
        return linear(heads.token, heads.token_bias) | transform_parameters(heads.token_transform)
    return linear(heads.question_answering, True) | transform_parameters(heads.token_transform)


def test_declared_heads_have_transformers_parameters_and_prefix():
    """The head parameters of each offered head are transformers' (its class built from the default config); a
    head whose base sits under another prefix than the base model's own declares that prefix (base_prefixes), and
    the others share one prefix, the base's."""
    wrong = []
    for spelling in registry().spellings():
        heads = declared(spelling)
        tasks = [task for task in offered_tasks(heads) if task in HEADS[spelling]]  # the rest: the test above
        for task in tasks:
            if HEADS[spelling][task]["parameters"] is None:
                wrong.append(f"{spelling} {task}: no layout in the table (its class did not build from transformers' "
                             "default config; see tools/write_head_table.py's default_config)")
                continue
            expected = set(HEADS[spelling][task]["parameters"])
            head = heads.sequence if task == SEQ else heads.multiple_choice if task == CHOICE else None
            if head is not None and head.pooling == "pooler":  # a pooler transformers' AutoModel leaves out (GTE's)
                expected = {name for name in expected if not name.startswith(HEADS[spelling][task]["prefix"] + ".")}
            if head_parameters(heads, task) != expected:
                wrong.append(f"{spelling} {task}: declares {sorted(head_parameters(heads, task))}, transformers' "
                             f"{HEADS[spelling][task]['class']} has {sorted(expected)}")
        prefixes = dict(heads.base_prefixes) if heads is not None else {}
        for task in set(tasks) & set(prefixes):
            if prefixes[task] != HEADS[spelling][task]["prefix"]:
                wrong.append(f"{spelling} {task}: base under {prefixes[task]!r}, transformers' under "
                             f"{HEADS[spelling][task]['prefix']!r}")
        own = {HEADS[spelling][task]["prefix"] for task in tasks if task not in prefixes}
        if len(own) > 1:
            wrong.append(f"{spelling}: transformers keeps the base under {sorted(own)}; declare base_prefixes")
    assert not wrong, "\n".join(wrong)


# a head transformers lacks, asked for: (config, task, the architecture as the message names it, its heads)
REFUSED = [
    ({"model_type": "cohere"}, SEQ, "'cohere'", "none"),
    ({"model_type": "olmo2"}, TOKEN, "'olmo2'", SEQ),
    ({"model_type": "opt"}, TOKEN, "'opt'", f"{SEQ}, {QA}"),
    ({"model_type": "gte"}, QA, "'gte'", f"{SEQ}, {TOKEN}"),
    ({"model_type": "deberta", "hidden_size": 16}, CHOICE, "'deberta'", f"{SEQ}, {TOKEN}, {QA}"),
    ({"model_type": "bert-generation"}, SEQ, "'bert-generation'", "none"),
    ({"model_type": "qwen2_vl"}, SEQ, "'qwen2_vl' (run as 'qwen2')", "none"),  # an alias: its own (no) heads
    ({"model_type": "llava", "text_config": {"model_type": "llama"}}, TOKEN, "'llava' (run as 'llama')", "none"),
]


@pytest.mark.parametrize("config, task, name, offered", REFUSED, ids=[f"{c['model_type']}-{t}" for c, t, *_ in REFUSED])
def test_a_head_transformers_lacks_is_refused(config, task, name, offered):
    auto = {SEQ: vkformers.AutoModelForSequenceClassification, TOKEN: vkformers.AutoModelForTokenClassification,
            QA: vkformers.AutoModelForQuestionAnswering, CHOICE: vkformers.AutoModelForMultipleChoice}[task]
    with pytest.raises(TaskHeadError) as error:
        auto.from_config(config)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"architecture {name} has no {task} head in vkformers (its task heads: {offered});")
