"""A user's draft directory (EAGLE head, DFlash draft) as the load finds it: damaged, incomplete, out of range, of the
other kind or trained for another model family. Each is refused when the engine starts, by a ValueError (or
FileNotFoundError) naming the draft's directory and the problem, before anything the config sizes is allocated;
never by a traceback from inside torch or safetensors, and never loaded as a draft whose every proposal is rejected.
An intact copy of the same draft serves plain decoding's ids."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_harness import load_runner
from specjet.models import dflash as dflash_module
from specjet.models.dflash import DFlashDraftModel, DFlashShape, load_dflash, save_dflash
from specjet.models.eagle import EagleDraftModel, load_eagle, save_eagle


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return load_runner(tiny_model_dir, tokens=64).config


@pytest.fixture(scope="module")
def drafts(config, tmp_path_factory):
    """An intact EAGLE head (EAGLE-3 features, a hot vocabulary) and DFlash draft (one layer, every option on) for
    the tiny target, written as the trainers write them."""
    root = tmp_path_factory.mktemp("drafts")
    torch.manual_seed(0)
    hot = torch.tensor([0, 1, 2, 5, 9, 100, 4000])
    save_eagle(EagleDraftModel(config, hot_token_ids=hot, feature_layers=(0,)), root / "eagle")
    shape = DFlashShape(1, (0,), 4, config.vocab_size - 1, root_context=True, known_prefix=True,
                        prev_token_input=True, position_masks=True)
    save_dflash(DFlashDraftModel(config, shape, hot_token_ids=hot), root / "dflash")
    return {"eagle": root / "eagle", "dflash": root / "dflash"}


LOADERS = {"eagle": load_eagle, "dflash": load_dflash}
WHAT = {"eagle": "EAGLE head", "dflash": "DFlash draft"}


def damaged_copy(drafts, kind, tmp_path, config_edit=None, tensors_edit=None, files_edit=None):
    folder = tmp_path / f"{kind}-copy"
    shutil.copytree(drafts[kind], folder)
    if config_edit is not None:
        meta = json.loads((folder / "config.json").read_text())
        config_edit(meta)
        (folder / "config.json").write_text(json.dumps(meta))
    if tensors_edit is not None:
        tensors = load_file(folder / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, folder / "model.safetensors")
    if files_edit is not None:
        files_edit(folder)
    return folder


def _cut_in_half(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _first_float(tensors):
    return next(name for name, t in sorted(tensors.items()) if t.is_floating_point())


def _as_int8(tensors):
    for name in [n for n, t in tensors.items() if t.is_floating_point()]:
        tensors[name] = tensors[name].to(torch.int8)


def _nan_in_one(tensors):
    name = _first_float(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")


def _narrow_fc(tensors):
    name = "fc.weight_t"
    tensors[name] = tensors[name][:-1].contiguous()


DAMAGE = {  # name: (edits, exception, what the message says after the draft's directory)
    "weights cut short": (dict(files_edit=_cut_in_half), ValueError, "does not read as safetensors"),
    "weights empty": (dict(files_edit=lambda f: (f / "model.safetensors").write_bytes(b"")), ValueError,
                      "does not read as safetensors"),
    "weights missing": (dict(files_edit=lambda f: (f / "model.safetensors").unlink()), FileNotFoundError,
                        "missing model.safetensors"),
    "config not JSON": (dict(files_edit=lambda f: (f / "config.json").write_text("{\"format\": ")), ValueError,
                        "does not read as JSON"),
    "config a list": (dict(files_edit=lambda f: (f / "config.json").write_text("[]")), ValueError,
                      "a JSON list, not an object"),
    "config without its target": (dict(config_edit=lambda m: m.pop("target")), ValueError,
                                  "does not name the target"),
    "integer weights": (dict(tensors_edit=_as_int8), ValueError, "is torch.int8; a draft's weights are floating"),
    "NaN weights": (dict(tensors_edit=_nan_in_one), ValueError, "holds NaN or infinite values"),
    "no hot ids": (dict(tensors_edit=lambda t: t.update(hot_token_ids=t["hot_token_ids"][:0])), ValueError,
                   "hot_token_ids must hold at least one"),
    "float hot ids": (dict(tensors_edit=lambda t: t.update(hot_token_ids=t["hot_token_ids"].float())), ValueError,
                      "hot_token_ids must be integer token ids"),
    "a tensor of another shape": (dict(tensors_edit=_narrow_fc), ValueError, r"tensor fc.weight_t has shape \[\d+, "),
}


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_draft_is_refused_naming_its_directory_and_the_problem(drafts, config, tmp_path, kind, damage):
    edits, error, says = DAMAGE[damage]
    folder = damaged_copy(drafts, kind, tmp_path, **edits)
    with pytest.raises(error, match=says) as refused:
        LOADERS[kind](folder, config)
    assert str(folder) in str(refused.value)
    LOADERS[kind](drafts[kind], config)  # the intact draft loads


@pytest.mark.parametrize("field,value,says", [
    ("block_size", "4", "block_size must be an integer, got '4'"),
    ("block_size", 4.0, "block_size must be an integer, got 4.0"),
    ("block_size", None, "block_size must be an integer, got None"),
    ("block_size", 1, "block_size >= 2"),
    ("num_layers", 0, ">= 1 layer"),
    ("mask_token_id", "x", "mask_token_id must be an integer"),
    ("mask_token_id", 10 ** 6, r"mask_token_id must lie in \[0, "),
    ("mask_token_id", -1, r"mask_token_id must lie in \[0, "),
    ("target_layers", None, "target_layers must be a list of layer ids, got None"),
    ("target_layers", "0", "target_layers must be a list of layer ids"),
    ("target_layers", [5], r"target_layers must be increasing layer ids in \[0, 1\), got \[5\]"),
    ("target_layers", [], "target_layers must be increasing layer ids"),
    ("root_context", "false", "root_context must be true or false, got 'false'"),
])
def test_a_dflash_config_field_of_another_type_or_out_of_range_is_refused(drafts, config, tmp_path, field, value, says):
    folder = damaged_copy(drafts, "dflash", tmp_path, config_edit=lambda m: m.update({field: value}))
    with pytest.raises(ValueError, match=says) as refused:
        load_dflash(folder, config)
    assert str(folder) in str(refused.value)


@pytest.mark.parametrize("field,value,says", [
    ("num_layers", 10 ** 6, r"num_layers=1000000, model.safetensors holds 1 layer"),  # a million layers to build
    ("block_size", 10 ** 9, r"mask_embedding has shape \[3, \d+\], its config \(block_size=1000000000"),  # 10**9 masks
    ("position_masks", False, r"mask_embedding has shape \[3, \d+\], its config \(block_size=4, position_masks=false"),
])
def test_a_config_that_sizes_more_than_its_weights_hold_is_refused_before_the_draft_is_built(
        drafts, config, tmp_path, monkeypatch, field, value, says):
    """A config's layer count and block size are sizes the draft allocates (a config saying a million layers held
    gigabytes before the missing tensors were noticed): they are checked against the weights first."""
    folder = damaged_copy(drafts, "dflash", tmp_path, config_edit=lambda m: m.update({field: value}))

    def never(*args, **kwargs):
        raise AssertionError("the draft was built from a config its weights do not fill")

    monkeypatch.setattr(dflash_module, "DFlashDraftModel", never)
    with pytest.raises(ValueError, match=says):
        load_dflash(folder, config)


def test_a_draft_for_another_model_family_of_the_same_shape_is_refused_naming_it(drafts, config):
    """A Llama target's draft beside a Qwen2 target of every same size (or the reverse): the families' layers differ
    (Qwen2's q/k/v biases), which the load named only as unexpected tensors."""
    qwen2 = dataclasses.replace(config, model_type="qwen2", attention_bias=True)
    for kind in ("eagle", "dflash"):
        with pytest.raises(ValueError, match=r"trained for a target with model_type='llama', this target has 'qwen2'"):
            LOADERS[kind](drafts[kind], qwen2)


def test_a_draft_of_the_other_kind_is_named(drafts, config):
    with pytest.raises(ValueError, match=r"not a specjet-dflash v1 draft .*it holds an EAGLE head "
                                         r"\(speculative_algorithm='EAGLE'\)"):
        load_dflash(drafts["eagle"], config)
    with pytest.raises(ValueError, match=r"not a specjet-eagle v1 head .*it holds a DFlash draft "
                                         r"\(speculative_algorithm='DFLASH'\)"):
        load_eagle(drafts["dflash"], config)


PARAMS = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["The cat sat on the mat. The cat", "1 2 3 4 1 2"]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """Plain decoding's ids (free-text drafting without an algorithm is a CPU engine's: every engine here is one)."""
    import specjet

    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, disable_guided_drafting=True,
                        device="cpu") as eng:
        ids = [o["output_ids"] for o in eng.generate(PROMPTS, PARAMS)]
        eng.check_kv_invariant()
    return ids


@pytest.mark.parametrize("algorithm,kind", [("EAGLE", "eagle"), ("DFLASH", "dflash"), (None, "dflash")])
def test_the_engine_refuses_a_damaged_user_draft_at_start_and_serves_with_the_intact_one(
        tiny_model_dir, drafts, expected, tmp_path, algorithm, kind):
    """At start, not mid-decode: the engine with the cut-short copy raises naming it; the intact copy (also as the
    default engine's free-text draft, without an algorithm) decodes plain decoding's ids."""
    import specjet

    params, prompts = PARAMS, PROMPTS
    damaged = damaged_copy(drafts, kind, tmp_path, files_edit=_cut_in_half)
    with pytest.raises(ValueError, match=re.escape(f"{WHAT[kind]} {damaged}: model.safetensors does not read as")):
        specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative_algorithm=algorithm,
                       speculative_draft_model_path=str(damaged), device="cpu")
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative_algorithm=algorithm,
                        speculative_draft_model_path=str(drafts[kind]), device="cpu") as eng:
        assert [eng.generate(p, params)["output_ids"] for p in prompts] == expected  # alone: each drafts
        assert [o["output_ids"] for o in eng.generate(prompts, params)] == expected
        eng.check_kv_invariant()


def test_the_engine_refuses_a_draft_for_another_model_family_at_start(tiny_model_dir, default_model_dir, drafts,
                                                                      tmp_path):
    """A Qwen2 target of the tiny Llama's every size, given the Llama's draft: refused naming model_type."""
    import specjet
    from conftest import make_tiny_model_dir

    qwen2 = make_tiny_model_dir(tmp_path / "qwen2", default_model_dir, model_type="qwen2", seed=3)
    for algorithm, kind in (("EAGLE", "eagle"), ("DFLASH", "dflash")):
        with pytest.raises(ValueError, match=re.escape(f"{WHAT[kind]} {drafts[kind]} was trained for a target with "
                                                       "model_type='llama', this target has 'qwen2'")):
            specjet.Engine(model_path=str(qwen2), max_total_tokens=1024, speculative_algorithm=algorithm,
                           speculative_draft_model_path=str(drafts[kind]))


@pytest.mark.parametrize("algorithm,kind", [("EAGLE", "eagle"), ("DFLASH", "dflash")])
def test_a_draft_path_under_the_home_folder_is_read_as_model_path_is(tiny_model_dir, drafts, expected, monkeypatch,
                                                                      algorithm, kind):
    """``~`` in speculative_draft_model_path is the home folder, as in model_path (it was looked up literally: "not
    found at ~/...")."""
    import specjet

    monkeypatch.setenv("HOME", str(drafts[kind].parent))
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative_algorithm=algorithm,
                        speculative_draft_model_path=f"~/{kind}", device="cpu") as eng:
        assert [o["output_ids"] for o in eng.generate(PROMPTS, PARAMS)] == expected
        eng.check_kv_invariant()


@pytest.mark.parametrize("kwargs,warned", [({"speculative_algorithm": "NGRAM"}, True),
                                           ({"disable_free_text_drafting": True}, True),
                                           ({"speculative_algorithm": "DFLASH"}, False), ({}, False)])
def test_a_draft_path_no_learned_draft_reads_is_named_in_a_warning(tiny_model_dir, drafts, expected, caplog, kwargs,
                                                                   warned):
    """NGRAM's trees or an engine without free-text drafting load no draft: the path given is named in a warning
    (it was ignored without a word), and the engine decodes plain decoding's ids; where the draft runs, no warning."""
    import logging

    import specjet

    with caplog.at_level(logging.WARNING, logger="specjet"):
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, device="cpu",
                            speculative_draft_model_path=str(drafts["dflash"]), **kwargs) as eng:
            assert [o["output_ids"] for o in eng.generate(PROMPTS, PARAMS)] == expected
            eng.check_kv_invariant()
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert str(drafts["dflash"]) in said[0] and "speculative_algorithm 'EAGLE' or 'DFLASH'" in said[0]
