"""The draft trainers' failures outside the happy path, on a tiny random target: an ``--out`` that cannot be written
is refused before any work (it failed at the save, after the whole run); a damaged feature shard, checkpoint or label
cache is an error that names the file and says what to do (it was a traceback naming none), and the file is left
where it was; SIGINT and SIGTERM during training end the step, write a checkpoint there and say how to resume
(SIGTERM killed the process with no word, SIGINT lost every step since the last checkpoint)."""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from conftest import SHARED_DATA
from model_harness import load_runner
from specjet.models.dflash import DFlashDraftModel, DFlashShape
from specjet.models.eagle import EagleDraftModel
from specjet.models.forward_batch import FeatureLayers
from specjet.train import data as D
from specjet.train import dflash_trainer as DT
from specjet.train import trainer as T
from specjet.train.features import DamagedFileError, extract_features, load_sequences

GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_flags(job: str, tiny_model_dir, root: pathlib.Path) -> list[str]:
    """A whole run in seconds: a few replies of a few tokens, a few steps."""
    flags = [job, "--model-path", str(tiny_model_dir), "--work-dir", str(root / "work"), "--json-per-schema", "0",
             "--num-target-replies", "2", "--num-human-replies", "3", "--num-eval", "1", "--num-few-shot-replies", "0",
             "--num-few-shot-eval", "0", "--max-new-tokens", "8", "--max-len", "96", "--batch-tokens", "512",
             "--warmup-steps", "1", "--threads", "1", "--hot-vocab", "300"]
    if job == "dflash":
        flags += ["--data-dir", str(root / "data"), "--block-size", "4", "--blocks-per-seq", "4",
                  "--known-prefix-rate", "0", "--autocast", "off"]
    else:
        flags += ["--feature-layers", "0", "--eval-steps", "2"]
    return flags


def can_write(folder: pathlib.Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no file can be made in: its write bits cleared, and where that does not stop this user (root) the
    immutable attribute set; skipped where neither can."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if can_write(folder) and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        if can_write(folder):
            pytest.skip("no way to make a read-only folder here (root without chattr)")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


# ---- 1. an --out that cannot be written


@pytest.mark.parametrize("job", ["eagle", "dflash"])
@pytest.mark.parametrize("where", ["in a read-only folder", "under a file"])
def test_an_unwritable_out_is_refused_before_any_work(job, where, tiny_model_dir, tmp_path, request, capsys):
    from specjet.train.__main__ import main

    if where == "under a file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder\n")
        out, probed = blocker / "draft", blocker
    else:
        probed = request.getfixturevalue("read_only_folder")
        out = probed / "new" / "draft"  # not there yet: its nearest existing parent is what must be writable
    before = sorted(probed.iterdir()) if probed.is_dir() else None
    with pytest.raises(SystemExit) as exit_:
        main(tiny_flags(job, tiny_model_dir, tmp_path) + ["--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--out" in err and str(out) in err, err
    # before any work: no reply generated, no feature computed; and no probe file left behind
    assert not list(tmp_path.rglob("*.jsonl")) and not (tmp_path / "work" / "features").exists()
    if before is not None:
        assert sorted(probed.iterdir()) == before


def test_the_writability_probe_leaves_nothing_behind(tmp_path):
    from specjet.train.eagle import check_writable

    check_writable(tmp_path, "--out")  # an existing empty folder
    check_writable(tmp_path / "a" / "b", "--out")  # a folder still to be made: probed in its nearest parent
    assert list(tmp_path.iterdir()) == []


# ---- 2. damaged shards, checkpoints and label caches


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    runner = load_runner(tiny_model_dir, tokens=1024)
    runner.model.requires_grad_(False)
    runner.model.lm_head.packed = None  # as the pipeline does: the head takes the draft's gradients
    return runner


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return D.gsm8k_human_samples(tokenizer, D.read_jsonl(GSM8K_TRAIN)[:4], max_len=96)


def damage(path: pathlib.Path, how: str) -> bytes:
    """Truncate ``path`` to half its bytes or overwrite it with text; returns the damaged bytes."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncated" else b"not what was written here\n")
    return path.read_bytes()


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_feature_shard_is_named_and_left_in_place(runner, samples, tmp_path, how):
    folder = tmp_path / "features"
    extract_features(runner, samples, folder, "features", shard_size=2, max_tokens=200)
    shard = folder / "shard_0001.safetensors"
    damaged = damage(shard, how)
    with pytest.raises(DamagedFileError) as error:
        load_sequences(folder)
    assert str(shard) in str(error.value) and "remove it" in str(error.value)
    assert error.value.path == shard and shard.read_bytes() == damaged  # not deleted, not rewritten
    # What the message says to do works: removed, the shard is computed again and the folder reads.
    shard.unlink()
    extract_features(runner, samples, folder, "features", shard_size=2, max_tokens=200)
    assert len(load_sequences(folder)) == len(samples)


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_checkpoint_is_named_and_left_in_place(runner, samples, tmp_path, how):
    seqs = load_sequences(_features(runner, samples, tmp_path))
    cfg = T.TrainConfig(steps=2, batch_tokens=256, warmup_steps=1, checkpoint_every=1)
    checkpoint = tmp_path / "checkpoint.pt"
    T.train(_eagle(runner), seqs, cfg, checkpoint)
    damaged = damage(checkpoint, how)
    with pytest.raises(DamagedFileError) as error:
        T.train(_eagle(runner), seqs, cfg, checkpoint)
    assert str(checkpoint) in str(error.value) and "delete it" in str(error.value)
    assert checkpoint.read_bytes() == damaged


def test_a_damaged_label_cache_is_named_and_left_in_place(runner, samples, tmp_path):
    seqs = load_sequences(_features(runner, samples, tmp_path, FeatureLayers((0,))))
    draft = _dflash(runner)
    cache = tmp_path / "labels.safetensors"
    labels = DT.cached_target_labels(draft, seqs, cache)
    damaged = damage(cache, "truncated")
    with pytest.raises(DamagedFileError) as error:
        DT.cached_target_labels(draft, seqs, cache)
    assert str(cache) in str(error.value) and cache.read_bytes() == damaged
    cache.unlink()
    assert all(torch.equal(a, b) for a, b in zip(DT.cached_target_labels(draft, seqs, cache), labels))


def test_the_trainer_command_names_a_damaged_shard_or_checkpoint(tiny_model_dir, tmp_path, capsys):
    """Through the command: exit 1 with the file's name and what to do, no traceback; the file stays."""
    from specjet.train.__main__ import main

    argv = tiny_flags("eagle", tiny_model_dir, tmp_path) + ["--steps", "2", "--out", str(tmp_path / "head")]
    main(argv)
    capsys.readouterr()
    shard = next((tmp_path / "work" / "features").glob("train-*/shard_0000.safetensors"))
    damaged = damage(shard, "truncated")
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and str(shard) in err and "remove it" in err and "Traceback" not in err, err
    assert shard.read_bytes() == damaged
    shard.unlink()  # as the message says: computed again
    checkpoint = next(shard.parent.glob("checkpoint-*.pt"))
    damaged = damage(checkpoint, "overwritten")
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and str(checkpoint) in err and "delete it" in err, err
    assert checkpoint.read_bytes() == damaged


def _features(runner, samples, tmp_path, capture="last") -> pathlib.Path:
    folder = tmp_path / "features"
    extract_features(runner, samples, folder, "features", shard_size=4, max_tokens=300, capture=capture)
    return folder


def _eagle(runner) -> EagleDraftModel:
    torch.manual_seed(0)
    return EagleDraftModel(runner.config).bind_target(runner.model)


def _dflash(runner) -> DFlashDraftModel:
    torch.manual_seed(0)
    return DFlashDraftModel(runner.config, DFlashShape(1, (0,), 4, runner.config.vocab_size - 1, False)).bind_target(
        runner.model)


# ---- 3. SIGINT and SIGTERM


@pytest.mark.parametrize("job", ["eagle", "dflash"])
def test_a_signal_during_training_ends_the_step_saves_it_and_resumes_exactly(job, runner, samples, tmp_path,
                                                                             monkeypatch):
    """SIGINT (a real signal to this process) in the middle of step 5: the step finishes, the checkpoint holds step 5
    (the last periodic one was step 3), and the resumed run ends where an uninterrupted one does, bit for bit."""
    module = T if job == "eagle" else DT
    capture = "last" if job == "eagle" else FeatureLayers((0,))
    seqs = load_sequences(_features(runner, samples, tmp_path, capture))
    cfg = (T.TrainConfig(steps=8, batch_tokens=256, warmup_steps=1, checkpoint_every=3) if job == "eagle" else
           DT.DFlashTrainConfig(steps=8, batch_tokens=256, blocks_per_seq=4, warmup_steps=1, checkpoint_every=3))
    new = _eagle if job == "eagle" else _dflash
    reference = new(runner)
    module.train(reference, seqs, cfg, tmp_path / "reference.pt")

    real, calls = module.batch_loss, {"n": 0}

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "batch_loss", signalled)
    checkpoint = tmp_path / "stopped.pt"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as stopped:
        module.train(new(runner), seqs, cfg, checkpoint)
    assert isinstance(stopped.value, T.Stopped) and stopped.value.signal_name == "SIGINT"
    assert stopped.value.step == 5 and stopped.value.checkpoint == checkpoint
    assert torch.load(checkpoint, weights_only=False)["step"] == 5
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # the loop's are gone
    monkeypatch.setattr(module, "batch_loss", real)
    resumed = new(runner)
    module.train(resumed, seqs, cfg, checkpoint)
    for (name, p), q in zip(reference.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


class Steps(int):
    """A step count whose loop test after the last step (``step < cfg.steps`` asks ``Steps.__gt__``: a subclass's
    reflected operator goes first) raises SIGTERM: a signal after that step's own check. (At module level: the
    checkpoint pickles the config.)"""

    def __gt__(self, step):
        if step == int(self):
            signal.raise_signal(signal.SIGTERM)
        return int(self) > step


@pytest.mark.parametrize("job", ["eagle", "dflash"])
def test_a_signal_after_the_last_steps_check_still_stops_the_run(job, runner, samples, tmp_path):
    """A signal that comes once the last step was checked (here: as the loop tests its bound after that step) is not
    dropped with the loop's handlers: the run stops there, its last checkpoint written, instead of going on to its
    evaluation and save as if nothing had come."""
    module = T if job == "eagle" else DT
    capture = "last" if job == "eagle" else FeatureLayers((0,))
    seqs = load_sequences(_features(runner, samples, tmp_path, capture))

    cfg = (T.TrainConfig(steps=Steps(4), batch_tokens=256, warmup_steps=1, checkpoint_every=3) if job == "eagle" else
           DT.DFlashTrainConfig(steps=Steps(4), batch_tokens=256, blocks_per_seq=4, warmup_steps=1,
                                checkpoint_every=3))
    model = _eagle(runner) if job == "eagle" else _dflash(runner)
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(T.Stopped) as stopped:
        module.train(model, seqs, cfg, checkpoint)
    assert stopped.value.signal_name == "SIGTERM" and stopped.value.step == 4
    assert torch.load(checkpoint, weights_only=False)["step"] == 4


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {what} within {timeout} s")


class _Run:
    """The trainer command in a process of its own (a signal to it is a signal to a real run), its output read as it
    comes."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for chunk in iter(lambda: stream.read(1), ""):
            into.append(chunk)

    def stdout(self) -> str:
        return "".join(self.out)

    def stop(self, signum: int) -> tuple[int, str]:
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=120)
        for reader in self.readers:
            reader.join(timeout=10)
        return code, "".join(self.err)


def _checkpoint_step(folder: pathlib.Path) -> int:
    found = list(folder.glob("features/train-*/checkpoint-*.pt"))
    if not found:
        return 0
    try:
        return torch.load(found[0], weights_only=False)["step"]
    except Exception:  # being replaced as it is read
        return 0


def test_sigterm_and_sigint_during_training_save_and_say_how_to_resume(tiny_model_dir, tmp_path):
    """The command in its own process: SIGTERM during training ends with 143 after writing a checkpoint at the step
    it came in, and says how to resume: the printed command; that command resumes from the step (stdout says so);
    SIGINT then ends with 130, the same way."""
    argv = tiny_flags("eagle", tiny_model_dir, tmp_path) + ["--steps", "100000", "--checkpoint-every", "2",
                                                            "--out", str(tmp_path / "head")]
    run = _Run([sys.executable, "-m", "specjet.train", *argv])
    _wait_for(lambda: _checkpoint_step(tmp_path / "work") >= 2, "a first checkpoint", run.proc)
    code, err = run.stop(signal.SIGTERM)
    said = re.search(r"stopped by SIGTERM after step (\d+), its checkpoint written to (\S+)\.", err)
    assert code == 128 + signal.SIGTERM and said, err
    step, checkpoint = int(said.group(1)), pathlib.Path(said.group(2))
    assert step >= 2 and torch.load(checkpoint, weights_only=False)["step"] == step
    command = err.strip().splitlines()[-1].strip()
    assert command == shlex.join(["python", "-m", "specjet.train", *argv]), err  # --threads given: as it was

    resumed = _Run([sys.executable, *shlex.split(command)[1:]])
    _wait_for(lambda: f"resuming from step {step} ({checkpoint})" in resumed.stdout(), "the resume", resumed.proc)
    _wait_for(lambda: _checkpoint_step(tmp_path / "work") > step, "a step after the resume", resumed.proc)
    code, err = resumed.stop(signal.SIGINT)
    said = re.search(r"stopped by SIGINT after step (\d+), its checkpoint written to (\S+)\.", err)
    assert code == 130 and said and int(said.group(1)) > step, err
    assert torch.load(checkpoint, weights_only=False)["step"] == int(said.group(1))
    assert "the same command resumes" in err and err.strip().splitlines()[-1].strip() == command


def test_the_resume_command_keeps_the_thread_count():
    """Without --threads a run takes the cores it may use; the resume command names the count it ran under, since a
    run under another count is another run (its checkpoint is not this one's)."""
    from specjet.train.eagle import resume_command

    assert resume_command("dflash", ["--out", "/tmp/a b", "--threads", "3"]) == \
        "python -m specjet.train dflash --out '/tmp/a b' --threads 3"
    assert resume_command("eagle", ["--steps", "9"]) == \
        f"python -m specjet.train eagle --steps 9 --threads {torch.get_num_threads()}"


# ---- 4. The data files a run reads

@pytest.mark.parametrize("content,says", [
    ('{"text": "fine"}\n{"text": "cut\n', r":2: not a JSON line"),
    ('{"text": "fine"}\n["a", "list"]\n', r":2: a JSON object per line expected, got a list"),
    ('{"messages": "hello"}\n', r":1: 'messages' must be a non-empty list of messages"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}\n', r":1: the last message must be the assistant's reply"),
    ('{"text": 5}\n', r":1: 'text' must be a string"),
    ('{"prompt": "x"}\n', r":1: expected a 'messages' or a 'text' field"),
    (b"\xff\xfe not utf-8\n", r": cannot be read as UTF-8 text")])
def test_a_bad_extra_jsonl_is_named_with_its_line(tiny_model_dir, tmp_path, content, says):
    """A user's --extra-jsonl that does not read as the trainers expect: an InputFileError naming the file and the
    line (json, torch and the chat template's errors named neither)."""
    from transformers import AutoTokenizer

    from specjet.train.data import InputFileError, extra_samples

    path = tmp_path / "extra.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputFileError, match=re.escape(str(path)) + says):
        extra_samples(AutoTokenizer.from_pretrained(tiny_model_dir), path, 64)


def test_bad_gsm8k_and_schema_files_are_named(tmp_path):
    """--gsm8k records without their fields and a schema set whose index or schema does not parse: named."""
    from specjet.train.data import InputFileError, gsm8k_split, load_schemas

    gsm8k = tmp_path / "train.jsonl"
    gsm8k.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "no answer"}\n')
    with pytest.raises(InputFileError, match=re.escape(f"{gsm8k}: record 2 lacks the GSM8K fields")):
        gsm8k_split(gsm8k, 1, 0)
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "index.json").write_text('{"schemas": [{"file": "a.json", "prompt": "A"}]}')
    (folder / "a.json").write_text('{"type": "object",')
    with pytest.raises(InputFileError, match=re.escape(f"{folder / 'a.json'}: does not read as JSON")):
        load_schemas(folder)
    (folder / "index.json").write_text('{"entries": []}')
    with pytest.raises(InputFileError, match=re.escape(f"{folder / 'index.json'}: expected")):
        load_schemas(folder)
    (folder / "a.json").write_text('{"type": "object"}')
    (folder / "index.json").write_text('{"schemas": [{"file": "a.json", "prompt": "A"}]}')
    assert load_schemas(folder) == [{"file": "a.json", "prompt": "A", "schema": {"type": "object"}}]


def test_the_trainer_command_names_a_bad_data_file(tiny_model_dir, tmp_path, capsys):
    """Through the command: exit 2 with the file and line, no traceback."""
    from specjet.train.__main__ import main

    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"text": "The quick brown fox."}\n{"text": "cut\n')
    argv = tiny_flags("eagle", tiny_model_dir, tmp_path) + ["--steps", "2", "--out", str(tmp_path / "head"),
                                                            "--extra-jsonl", str(extra)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{extra}:2: not a JSON line" in err and "Traceback" not in err, err
