"""The architecture registry and the five family plugins (no GPU needed).

Needs the plugins installed: pip install -e plugins/llama -e plugins/bert -e plugins/t5 -e plugins/moe -e plugins/ssm
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest

from vkformers.cli import architectures as architectures_cli
from vkformers.errors import (ArchitectureDeclarationError, DuplicateArchitectureError, UnknownArchitectureError,
                              VkformersError)
from vkformers.models import plugins
from vkformers.models.family import Family, FamilyPlugin
from vkformers.models.hookspecs import hookimpl
from vkformers.models.known_families import KNOWN_FAMILIES
from vkformers.models.registry import NESTED_TEXT_CONFIG, Architecture, Registry

TSV = Path(__file__).parent / "data" / "hierarchos_architectures.tsv"
TOOLS = Path(__file__).resolve().parent.parent / "tools"

# The reference list's bracketed targets, and a config that names a backbone through each.
WRAPPER_CONFIGS = {
    "(nested text_config)": lambda backbone: {"text_config": {"model_type": backbone}},
    "(nested thinker_config.text_config)": lambda backbone: {"thinker_config": {"text_config": {"model_type": backbone}}},
    "(nested encoder/decoder configs)": lambda backbone: {"encoder": {"model_type": "bert"}, "decoder": {"model_type": backbone}},
}
# Architectures registered beyond the reference list (canonical names without aliases), by family.
BEYOND_REFERENCE = {"mamba": "ssm", "falcon_mamba": "ssm", "mamba2": "ssm", "bamba": "ssm", "falcon_h1": "ssm",
                    "nemotron_h": "ssm", "jamba": "ssm", "granitemoehybrid": "ssm",
                    "exaone": "llama", "internlm3": "llama", "iquestcoder": "llama",
                    "sarvam_moe": "moe", "sarvam_mla": "moe", "apertus1p5_text": "llama",
                    "diffllama": "llama", "jetmoe": "moe",
                    "deberta-v2": "bert", "deberta": "bert", "mpnet": "bert", "gte": "bert", "ibert": "bert",
                    "squeezebert": "bert", "xmod": "bert", "fnet": "bert", "longformer": "bert", "mobilebert": "bert",
                    "luke": "bert", "convbert": "bert", "lfm2": "ssm", "zamba": "ssm", "zamba2": "ssm",
                    "recurrent_gemma": "ssm", "longt5": "t5", "led": "t5", "nllb-moe": "t5", "prophetnet": "t5",
                    "rwkv": "ssm", "xlstm": "ssm", "minimax": "ssm",
                    "lfm2_moe": "ssm", "doge": "llama", "kimi_linear": "moe", "gemma3n_text": "llama",
                    "nystromformer": "bert", "yoso": "bert", "funnel": "bert",
                    "gemma4_text": "moe", "gemma4_unified_text": "moe",
                    "lfm3": "ssm", "cpmant": "llama", "dots3_note_text": "moe",
                    "t5gemma2": "t5", "xlnet": "llama"}
# Spellings of the reference list that it runs through a wrapper and that are now canonical architectures (the
# generic encoder-decoder: core composes its encoder and decoder); they stay one spelling each.
PROMOTED = {"encoder-decoder": "t5"}
CANONICAL = 143 + len(BEYOND_REFERENCE) + len(PROMOTED)
# the reference list's architectures per family, plus those beyond it
EXPECTED_PER_FAMILY = {family: count + sum(1 for f in [*BEYOND_REFERENCE.values(), *PROMOTED.values()] if f == family)
                       for family, count in {"llama": 63, "moe": 38, "bert": 25, "t5": 17, "ssm": 0}.items()}
SPELLINGS = 224 + len(BEYOND_REFERENCE)


def reference_rows() -> list[tuple[str, str]]:
    """(model_type, canonical) of the 143 canonical + 81 alias rows."""
    with TSV.open(newline="") as handle:
        return [
            (row["model_type"], row["canonical"])
            for row in csv.DictReader(handle, delimiter="\t")
            if not row["family_or_notes"].startswith("LATER-REVISION-ONLY")
        ]


def registry_of(*family_plugins) -> Registry:
    """A registry built from the given plugins only, ignoring what is installed."""
    manager = plugins.new_plugin_manager(load_entry_points=False)
    for plugin in family_plugins:
        manager.register(plugin, name=plugin.family)
    return Registry(manager)


class ToyPlugin:
    """A third-party plugin, written the way one would outside this repository."""

    @hookimpl
    def vkformers_architectures(self):
        return [Architecture(name="toy_decoder", family="toy", kind="causal-decoder", tasks=("causal-lm",))]

    @hookimpl
    def vkformers_aliases(self):
        return {"toy-decoder-v2": "toy_decoder", "my_llama": "llama"}


class ClaimsLlamaPlugin:
    @hookimpl
    def vkformers_architectures(self):
        return [Architecture(name="llama", family="rival", kind="causal-decoder", tasks=("causal-lm",))]


class ClaimsCodeLlamaAliasPlugin:
    @hookimpl
    def vkformers_aliases(self):
        return {"code_llama": "llama"}


@pytest.fixture
def registry() -> Registry:
    return plugins.registry()


def test_the_plugins_register_the_reference_list_and_the_architectures_beyond_it(registry):
    assert len(registry.architectures()) == CANONICAL
    assert len(registry.spellings()) == SPELLINGS
    assert registry.families() == sorted(EXPECTED_PER_FAMILY)
    per_family = {family: sum(1 for a in registry.architectures() if a.family == family) for family in EXPECTED_PER_FAMILY}
    assert per_family == EXPECTED_PER_FAMILY


def test_registered_spellings_are_exactly_the_reference_list(registry):
    assert sorted([model_type for model_type, _ in reference_rows()] + list(BEYOND_REFERENCE)) == registry.spellings()
    assert all(registry.get(name).family == family for name, family in BEYOND_REFERENCE.items())


@pytest.mark.parametrize("model_type,canonical", reference_rows())
def test_reference_spelling_resolves_to_its_canonical(registry, model_type, canonical):
    if model_type in PROMOTED:
        assert registry.resolve(model_type).name == model_type
        assert registry.get(model_type).family == PROMOTED[model_type]
    elif canonical in WRAPPER_CONFIGS:
        config = {"model_type": model_type, **WRAPPER_CONFIGS[canonical]("mistral")}
        assert registry.resolve(config).name == "mistral"
        with pytest.raises(UnknownArchitectureError, match="pass the config dict"):
            registry.resolve(model_type)
    else:
        assert registry.resolve(model_type).name == canonical
        assert registry.resolve({"model_type": model_type}).name == canonical


def test_wrapper_resolves_through_nested_aliases(registry):
    config = {"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {"model_type": "qwen3_omni_moe_text"}}}
    assert registry.resolve(config).name == "qwen3_moe"
    with pytest.raises(UnknownArchitectureError, match="does not have it"):
        registry.resolve({"model_type": "llava", "vision_config": {}})


def test_spelling_resolution_tolerates_dash_underscore_and_case(registry):
    assert registry.resolve("open_llama").name == "open-llama"
    assert registry.resolve("XLM_Roberta").name == "xlm-roberta"
    assert registry.resolve("code-llama").name == "llama"


def test_aliases_of_lists_direct_aliases(registry):
    assert registry.aliases_of("llama") == ["code_llama", "mllama", "mllama_text_model", "paddleocr_vl_text"]
    assert registry.aliases_of("gpt2") == []


def test_get_does_not_resolve_aliases(registry):
    assert registry.get("llama").name == "llama"
    with pytest.raises(UnknownArchitectureError):
        registry.get("code_llama")


def test_unknown_type_names_close_matches_and_their_plugin(registry):
    with pytest.raises(UnknownArchitectureError) as error:
        registry.resolve("lama")
    message = str(error.value)
    assert "'lama'" in message
    assert "'llama' (vkformers-llama)" in message
    assert isinstance(error.value, VkformersError)


def test_type_of_a_missing_plugin_says_what_to_install():
    import vkformers_llama.plugin

    llama_only = registry_of(vkformers_llama.plugin.plugin)
    with pytest.raises(UnknownArchitectureError, match="pip install vkformers-bert"):
        llama_only.resolve("bert")
    with pytest.raises(UnknownArchitectureError) as error:
        llama_only.resolve("roberto")
    assert "'roberta' (vkformers-bert, not installed: pip install vkformers-bert)" in str(error.value)
    # architectures with mixture-of-experts layers are vkformers-moe's, even when a config makes every layer dense
    for name in ("hy_v3", "laguna", "deepseek_v2", "mistral4"):
        with pytest.raises(UnknownArchitectureError, match=f"'{name}' is provided by the vkformers-moe plugin, which "
                                                           f"is not installed: pip install vkformers-moe"):
            llama_only.resolve({"model_type": name})


def test_third_party_plugin_adds_architecture_and_alias_without_touching_core():
    toy = ToyPlugin()
    plugins.register_plugin(toy, name="toy")
    try:
        registry = plugins.registry()
        assert registry.resolve("toy-decoder-v2") == registry.get("toy_decoder")
        assert registry.get("toy_decoder").family == "toy"
        assert registry.resolve("my_llama").name == "llama"
        assert len(registry.architectures()) == CANONICAL + 1
    finally:
        plugins.unregister_plugin(toy)
    with pytest.raises(UnknownArchitectureError):
        plugins.registry().resolve("toy_decoder")


@pytest.mark.parametrize("rival", [ClaimsLlamaPlugin, ClaimsCodeLlamaAliasPlugin])
def test_duplicate_registration_is_refused(rival):
    with pytest.raises(DuplicateArchitectureError, match="registered twice: by plugin 'llama'"):
        plugins.register_plugin(rival(), name="rival")
    # The refused plugin is left out; the registry still works.
    assert len(plugins.registry().architectures()) == CANONICAL


def test_alias_to_an_unregistered_architecture_is_refused():
    class DanglingAliasPlugin:
        @hookimpl
        def vkformers_aliases(self):
            return {"ghost_v2": "ghost"}

    with pytest.raises(UnknownArchitectureError, match="'ghost_v2'.*'ghost'"):
        plugins.register_plugin(DanglingAliasPlugin(), name="dangling")


def test_only_the_llama_plugin_claims_verification_so_far(registry):
    # Each claim is proven by tests/test_verified_claims.py (llama and moe: causal decoders) or
    # tests/test_verified_claims_encoder.py (bert: encoders) or tests/test_verified_claims_seq2seq.py
    # (t5: encoder-decoders); ssm's causal decoders by tests/test_verified_claims.py too.
    claimed = {a.family for a in registry.architectures() if a.status != "registered"}
    assert claimed <= {"llama", "moe", "bert", "t5", "ssm"}


def test_each_plugin_holds_only_its_kind(registry):
    for architecture in registry.architectures():
        kind, moe = architecture.kind, architecture.trait("moe")
        expected = (BEYOND_REFERENCE.get(architecture.name) or {"encoder": "bert", "encoder-decoder": "t5"}.get(kind)
                    or ("moe" if moe else "llama"))
        assert architecture.family == expected, architecture.name


def test_known_families_index_matches_the_plugins(registry):
    owners = {a.name: a.family for a in registry.architectures()}
    owners.update({alias.spelling: alias.family for alias in registry.aliases()})
    assert owners == KNOWN_FAMILIES, "known_families.py is out of step; run: python tools/write_known_families.py"


def test_known_families_file_is_what_the_tool_writes_from_the_declarations():
    spec = importlib.util.spec_from_file_location("write_known_families", TOOLS / "write_known_families.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.TARGET.read_text() == tool.render(tool.spelling_families()), (
        "core/vkformers/models/known_families.py is out of step with the plugins' declarations; "
        "run: python tools/write_known_families.py")


def toy_family() -> Family:
    """A third party's family, declared the way the four plugins declare theirs."""
    family = Family("toyfam", kind="causal-decoder", norm="rms")

    @family.architecture("toy_base", llama_layout=True, status="verified", notes="the parent",
                         aliases=["toy-base-v2"])
    @family.architecture("toy_twin", norm="layer")  # a second name on the same variant
    def toy_base(config: dict) -> str:
        return "base"

    family.architecture("toy_child", moe=True, model_class="vkformers.models.module:Module",
                        variant=lambda config: "child")
    family.wrappers({"toy_wrapper": NESTED_TEXT_CONFIG})
    return family


class ToySharedModel:
    pass


def test_a_family_declaration_gives_the_registry_rows_aliases_statuses_and_variants():
    family = toy_family()
    registry = registry_of(FamilyPlugin(family, Path(__file__).parent, model_classes={"causal-lm": ToySharedModel}))
    base = registry.get("toy_base")
    assert (base.family, base.kind, base.tasks, base.status, base.notes) == (
        "toyfam", "causal-decoder", ("causal-lm",), "verified", "the parent")
    assert dict(base.traits) == {"llama_layout": True, "moe": False, "norm": "rms"}
    assert dict(registry.get("toy_twin").traits) == {"llama_layout": False, "moe": False, "norm": "layer"}
    assert registry.get("toy_child").trait("moe") is True
    assert registry.resolve("toy-base-v2") == base
    wrapped = {"model_type": "toy_wrapper", "text_config": {"model_type": "toy_child"}}
    assert registry.resolve(wrapped).name == "toy_child"
    assert family.statuses() == {"toy_base": "verified"}
    assert {name: variant({}) for name, variant in family.variants().items()} == {
        "toy_base": "base", "toy_twin": "base", "toy_child": "child"}


def test_a_declared_model_class_replaces_the_shared_one_for_that_architecture_only():
    from vkformers.models.module import Module

    plugin = FamilyPlugin(toy_family(), Path(__file__).parent, model_classes={"causal-lm": ToySharedModel})
    registry = registry_of(plugin)
    assert plugin.vkformers_model_class(registry.get("toy_child"), "causal-lm") is Module
    assert plugin.vkformers_model_class(registry.get("toy_base"), "causal-lm") is ToySharedModel
    assert plugin.vkformers_model_class(registry.get("toy_child"), "masked-lm") is None


def test_moe_architectures_with_their_own_class_get_it_from_their_declaration(registry):
    from vkformers_moe.model import (DeepseekV4ForCausalLM, Glm5NextForCausalLM, MoeDecoderForCausalLM,
                                     Qwen4ExpForCausalLM)

    def model_class(name):
        return plugins.plugin_manager().hook.vkformers_model_class(architecture=registry.get(name), task="causal-lm")

    assert model_class("deepseek_v4") is DeepseekV4ForCausalLM
    assert model_class("glm5_next_text") is Glm5NextForCausalLM
    assert model_class("qwen4_exp_text") is Qwen4ExpForCausalLM
    assert model_class("mixtral") is MoeDecoderForCausalLM


@pytest.mark.parametrize("declare, error, fragment", [
    (lambda f: f.architecture("a", variant=len), ArchitectureDeclarationError, "declares no norm"),
    (lambda f: f.architecture("a", norm="rms", status="proven", variant=len), ArchitectureDeclarationError,
     "status 'proven'"),
    (lambda f: f.architecture("a", norm="rms", kind="decoder", variant=len), ArchitectureDeclarationError,
     "kind 'decoder'"),
    (lambda f: [f.architecture("a", norm="rms", variant=len) for _ in range(2)], DuplicateArchitectureError,
     "declares architecture 'a' twice"),
    (lambda f: f.wrappers({"w": "a"}), ArchitectureDeclarationError, "wrapper 'w' needs a NestedConfig"),
    (lambda f: [f.architecture(n, norm="rms", aliases=["x"], variant=len) for n in "ab"] and f.aliases(),
     DuplicateArchitectureError, "declares alias 'x' twice"),
    (lambda f: f.architecture("a", norm="rms", model_class="no_colon", variant=len) and f.model_class("a"),
     ArchitectureDeclarationError, "package.module:ClassName"),
])
def test_a_malformed_declaration_is_refused_naming_what_is_wrong(declare, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        declare(Family("toyfam", kind="causal-decoder"))


def test_a_class_per_task_serves_those_tasks_only():
    """model_class={task: class}: the declared class of each task (a mapping's task the architecture's kind lacks,
    such as "base", included); any other task has no class, not the plugin's shared one."""
    family = Family("toyfam", kind="encoder")
    family.architecture("a", norm="layer", model_class={"masked-lm": Registry, "base": Architecture}, variant=len)
    plugin = FamilyPlugin(family, Path(__file__).parent, model_classes={"masked-lm": Family, "base": Family,
                                                                          "sequence-classification": Family})
    architecture = registry_of(plugin).resolve({"model_type": "a"})
    assert plugin.vkformers_model_class(architecture=architecture, task="masked-lm") is Registry
    assert plugin.vkformers_model_class(architecture=architecture, task="base") is Architecture
    assert plugin.vkformers_model_class(architecture=architecture, task="sequence-classification") is None


def test_kernel_dirs_is_a_flat_list():
    assert isinstance(plugins.kernel_dirs(), list)


def run_architectures_command(capsys, **options) -> tuple[int, str, str]:
    args = argparse.Namespace(**{"json": False, "family": None, "status": None, **options})
    exit_code = architectures_cli.run(args)
    captured = capsys.readouterr()
    return exit_code, captured.out, captured.err


def test_architectures_json_counts(capsys):
    exit_code, out, _ = run_architectures_command(capsys, json=True)
    assert exit_code == 0
    listing = json.loads(out)
    counts = listing["counts"]
    assert (counts["canonical"], counts["spellings"]) == (CANONICAL, SPELLINGS)
    assert counts["verified"] + counts["forward-verified"] + counts["registered"] == CANONICAL
    statuses = [row["status"] for row in listing["architectures"]]
    assert counts["verified"] == statuses.count("verified")
    assert len(listing["architectures"]) == CANONICAL


def test_architectures_table_summary_line(capsys):
    exit_code, out, _ = run_architectures_command(capsys)
    assert exit_code == 0
    statuses = [a.status for a in plugins.registry().architectures()]
    expected = (f"{CANONICAL} canonical, {SPELLINGS} spellings; {statuses.count('verified')} verified, "
                f"{statuses.count('forward-verified')} forward-verified, {statuses.count('registered')} registered")
    assert expected in out


def test_architectures_family_filter(capsys):
    _, out, _ = run_architectures_command(capsys, json=True, family="t5")
    listing = json.loads(out)
    assert {row["family"] for row in listing["architectures"]} == {"t5"}
    assert listing["counts"]["canonical"] == EXPECTED_PER_FAMILY["t5"]


def test_architectures_unknown_family_exits_2_listing_families(capsys):
    exit_code, _, err = run_architectures_command(capsys, family="gpt")
    assert exit_code == 2
    assert "bert, llama, moe, ssm, t5" in err


def test_public_subpackages_are_attributes_after_import():
    import subprocess
    import sys
    # a fresh interpreter: this one has imported the submodules already
    code = ("import vkformers as v; print(v.optim.AdamW.__name__, v.training.Trainer.__name__, "
            "v.engine.functional.softmax.__name__, v.models.loading.AutoModelForCausalLM.__name__, "
            "v.runtime.Device.__name__, v.errors.InputError.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AdamW", "Trainer", "softmax", "AutoModelForCausalLM", "Device", "InputError"]
