"""Learned reward models (rlctl/rm/learned.py): scoring equals a manual forward at
the last non-pad token, the model's own tokenizer and chat template are used, running
normalisation and clipping against numpy, the statistics survive a checkpoint, the gold
reward is logged beside the proxy in a real `rlctl train`, the critic starts from the
reward model, and bad directories get one line (exit 2) before a run directory."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          PreTrainedTokenizerFast)

from rlctl.demo import tiny
from rlctl.models.value import SeparateCritic
from rlctl.rm.learned import (LearnedRewards, RewardModel, RunningNorm, batch_stats,
                                      build_learned_rewards)
from rlctl.tasks.scoring import RewardScorer
from rlctl.tasks.sorting import SortingTask
from rlctl.types import Example

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
CHAT = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}")


def _reversed_tokenizer(chat: bool = False):
    """A word-level tokenizer over the tiny model's symbols in the reverse order (so its ids
    differ from the policy's), with role markers for a chat template."""
    symbols = tiny.SYMBOLS[::-1] + ["<user>", "<assistant>"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + symbols)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>", padding_side="right")
    if chat:
        tok.chat_template = CHAT
    return tok


def _classifier(tok, num_labels=1, seed=0, dtype=torch.float64):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                      num_labels=num_labels)
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(cfg).to(dtype)


def save_rm(path, tok=None, dtype=torch.float64, num_labels=1):
    tok = tok or tiny.build_tokenizer()
    _classifier(tok, num_labels, dtype=dtype).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def _manual(rm: RewardModel, text: str) -> float:
    """One unpadded sequence through the stock HF forward (its own pooling)."""
    ids = rm.tokenizer(text, return_tensors="pt",
                       add_special_tokens=not rm.tokenizer.chat_template)["input_ids"]
    with torch.no_grad():
        return float(rm.load()(input_ids=ids).logits[0, 0])


EXAMPLES = [Example(prompt="3 1 4 =", fields={"digits": [3, 1, 4]}),
            Example(prompt="9 =", fields={"digits": [9]}),
            Example(prompt="2 7 1 8 2 8 =", fields={"digits": [2, 7, 1, 8, 2, 8]})]
COMPLETIONS = ["1 3 4", "9 9 9 9 9 9 9", "1"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_score_is_the_head_at_the_last_non_pad_token(tmp_path, side):
    rm = RewardModel(save_rm(tmp_path / "rm"))
    rm.tokenizer.padding_side = side
    got = rm.score(EXAMPLES, COMPLETIONS)
    texts = [rm.text(e, c) for e, c in zip(EXAMPLES, COMPLETIONS)]
    assert texts[0] == "3 1 4 = 1 3 4"
    assert rm.load().dtype == torch.float64           # the saved dtype, not float32
    # float64, yet not to 1e-15: Llama's rotary cos/sin tables are float32, so the same
    # token at another absolute position (padding) rounds differently; measured 7e-10.
    # Reading the token before the last one moves these scores by >= 5e-4 (measured).
    np.testing.assert_allclose(got, [_manual(rm, t) for t in texts], rtol=0, atol=1e-8)
    assert len(set(got)) == 3


def test_own_tokenizer_and_chat_template(tmp_path):
    tok = _reversed_tokenizer(chat=True)
    rm = RewardModel(save_rm(tmp_path / "rm", tok))
    text = rm.text(EXAMPLES[0], COMPLETIONS[0])
    assert text == "<user> 3 1 4 = <eos> <assistant> 1 3 4 <eos> "
    own = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    policy = tiny.build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert own != policy                                # the ids really differ
    got = rm.score(EXAMPLES, COMPLETIONS)
    want = [_manual(rm, rm.text(e, c)) for e, c in zip(EXAMPLES, COMPLETIONS)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)   # as above


def test_running_norm_matches_numpy():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=n) * 10 ** rng.uniform(-1, 1) for n in (1, 7, 64, 3, 20)]
    norm, seen = RunningNorm(), []
    for b in batches:
        norm.merge(*batch_stats(b.tolist()))
        seen.extend(b.tolist())
        assert norm.count == len(seen)
        assert abs(norm.mean - np.mean(seen)) < 1e-12 * max(1, abs(np.mean(seen)))
        assert abs(norm.std - np.std(seen)) < 1e-12 * max(1, np.std(seen))
        x = 1.234
        want = (x - np.mean(seen)) / np.std(seen) if len(seen) > 1 else x - np.mean(seen)
        assert abs(norm.normalize(x) - want) < 1e-11


def test_shaping_normalises_the_batch_then_clips():
    learned = LearnedRewards([], replace_task=True, norm="running", clip=1.5)
    learned.norms["r"] = RunningNorm()
    first = [0.0, 1.0, 2.0, 10.0]
    learned.norms["r"].merge(*batch_stats(first))               # as score() does first
    out = learned.shaped("r", first)
    z = (np.array(first) - np.mean(first)) / np.std(first)     # stats include this batch
    np.testing.assert_allclose(out, np.clip(z, -1.5, 1.5), rtol=0, atol=1e-12)
    assert max(out) == 1.5 and z.max() > 1.5
    frozen = learned.shaped("r", [100.0])          # eval reads, never updates
    assert learned.norms["r"].count == 4 and frozen == [1.5]
    plain = LearnedRewards([], replace_task=True, norm="none", clip=None)
    assert plain.shaped("r", [-7.0, 3.0]) == [-7.0, 3.0]


def _scored_task(rm_dir, norm="running", clip=None):
    """(a sorting task, its reward models)."""
    return SortingTask(num_digits=3, num_eval=4), build_learned_rewards(str(rm_dir), [], norm, clip, "cpu")


def test_gold_logged_beside_the_proxy_and_state_round_trip(tmp_path):
    rm_dir = save_rm(tmp_path / "rm")
    task, learned = _scored_task(rm_dir)
    scorer, eval_scorer = RewardScorer(task, learned, timeout_s=0), RewardScorer(task, learned, timeout_s=0)
    totals = scorer.score_batch(EXAMPLES, COMPLETIONS)
    raw = learned.models[0].score(EXAMPLES, COMPLETIONS)
    assert scorer.last_components["reward_model"] == raw
    assert scorer.last_components["exact"] == [1.0, 0.0, 0.0]   # gold: computed, weight 0
    np.testing.assert_allclose(totals, (np.array(raw) - np.mean(raw)) / np.std(raw), atol=1e-12)
    assert eval_scorer.correct_batch(EXAMPLES, COMPLETIONS, eval_scorer.score_batch(
        EXAMPLES, COMPLETIONS)) == [True, False, False]             # exact match, not the proxy
    assert learned.norms["reward_model"].count == 3   # eval did not update
    state = json.loads(json.dumps(scorer.state()))                  # as a checkpoint stores it
    scorer.score_batch(EXAMPLES[:2], COMPLETIONS[:2])
    after = scorer.score_batch(EXAMPLES, COMPLETIONS)
    resumed = RewardScorer(*_scored_task(rm_dir), timeout_s=0)
    resumed.load_state(state)
    resumed.score_batch(EXAMPLES[:2], COMPLETIONS[:2])
    assert resumed.score_batch(EXAMPLES, COMPLETIONS) == after       # exact, float64 JSON


def test_critic_starts_at_the_reward_model_score(tmp_path):
    tok = tiny.build_tokenizer()
    rm = RewardModel(save_rm(tmp_path / "rm", tok, dtype=torch.float32))
    critic = SeparateCritic.from_sequence_classifier(rm.load())
    texts = ["3 1 4 = 1 3 4", "9 = 9", "2 7 1 8 = 1 2 7 8 8 8"]
    enc = tok(texts, return_tensors="pt", padding=True)                # the policy's left padding
    mask = enc["attention_mask"]
    with torch.no_grad():
        values = critic(enc["input_ids"], mask, (mask.cumsum(-1) - 1).clamp(min=0))  # [N, L]
    # float32, same ops in the same order on the same inputs: equal to rounding only
    np.testing.assert_allclose(values[:, -1].numpy(), rm.score_texts(texts), rtol=0, atol=1e-5)
    critic.value_head.summary.weight.data.add_(1.0)                   # trained apart from the RM
    assert float(rm.load().score.weight.sum()) != float(critic.value_head.summary.weight.sum())


# ---- the CLI: the console script, and the same app in-process ------------------------------
FAST = ["trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=2",
        "algo.group_size=2", "logger=jsonl", "logger.console=false", "rollout.max_new_tokens=6",
        "task.num_eval=4"]


def _rlctl(tmp_path, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([RLCTL, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=timeout)


def _in_process(rlctl_app):
    """``_rlctl``'s signature over the CLI app in-process."""
    return lambda tmp_path, *args: rlctl_app(*args, cwd=tmp_path)


def test_train_logs_proxy_and_gold(tmp_path):
    rm_dir = save_rm(tmp_path / "rm", dtype=torch.float32)
    out = _rlctl(tmp_path, "train", f"task.reward_model={rm_dir}", f"run.output_dir={tmp_path}/runs",
                 *FAST)
    assert out.returncode == 0, out.stderr[-2000:]
    run = next((tmp_path / "runs").iterdir())
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert "reward/exact" in r and "reward/positional" in r
        assert r["reward/mean"] == pytest.approx(r["reward/reward_model"], abs=1e-6)
    assert any("eval/exact_match" in r for r in rows)


def test_train_ppo_with_critic_from_the_reward_model(tmp_path, rlctl_app):
    rm_dir = save_rm(tmp_path / "rm", dtype=torch.float32)
    # the CLI app in-process (test_train_logs_proxy_and_gold runs the console script)
    out = rlctl_app("train", "algo=ppo", "algo.critic=separate",
                 "algo.critic_init=reward_model", "algo.critic_warmup_steps=1",
                 f"task.reward_model={rm_dir}", "task.reward_norm=running", "task.reward_clip=3",
                 f"run.output_dir={tmp_path}/runs", *FAST, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    run = next((tmp_path / "runs").iterdir())
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all("value/loss" in r and "reward/reward_model" in r for r in steps)
    assert all(abs(r["reward/mean"]) <= 3 for r in steps)          # clipped to [-3, 3]
    assert (run / "critic").is_dir()


def _bad_dirs(tmp_path):
    tok = tiny.build_tokenizer()
    causal = tmp_path / "causal"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)).save_pretrained(causal)
    tok.save_pretrained(causal)
    two = save_rm(tmp_path / "two", num_labels=2)
    no_tok = tmp_path / "notok"
    _classifier(tok).save_pretrained(no_tok)
    pickled = save_rm(tmp_path / "pickled")
    from safetensors.torch import load_file
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    other = save_rm(tmp_path / "other", _reversed_tokenizer())
    nohead = tmp_path / "nohead"          # a classifier config over the causal LM's weights
    shutil.copytree(causal, nohead)
    conf = json.loads((nohead / "config.json").read_text())
    conf.update(architectures=["LlamaForSequenceClassification"], num_labels=1,
                id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (nohead / "config.json").write_text(json.dumps(conf))
    return {"causal": causal, "two": two, "notok": no_tok, "pickled": pickled, "other": other,
            "nohead": nohead}


BAD = [
    (["task.reward_model={causal}"], "is not a sequence classifier (architectures: LlamaForCausalLM)"),
    (["task.reward_model={two}"], "has 2 labels; a reward model has one"),
    (["task.reward_model={notok}"], "has no tokenizer the reward model can use"),
    (["task.reward_model={pickled}"], "has pickled weights only (pytorch_model.bin)"),
    (["task.reward_model={nohead}"], "has no trained score head (score.weight missing from"),
    (["task.reward_norm=sometimes", "task.reward_model={two}"], "invalid task.reward_norm 'sometimes'"),
    (["task.reward_clip=-1"], "invalid task.reward_clip '-1.0'; must be > 0"),
    (["algo.critic_init=reward_model", "algo=ppo"], "needs algo.critic=separate"),
]


def test_bad_reward_models_one_line_before_a_run_dir(tmp_path, rlctl_app):
    """The first case through the console script, the others through the same CLI app
    in-process (no new interpreter's imports for each)."""
    dirs = _bad_dirs(tmp_path)
    for i, (args, fragment) in enumerate(BAD):
        out = (_rlctl if i == 0 else _in_process(rlctl_app))(
            tmp_path, "train", "trainer.steps=1", f"run.output_dir={tmp_path}/runs",
            *[a.format(**dirs) for a in args])
        lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
        assert out.returncode == 2, (args, out.stderr[-1500:])
        assert "Traceback" not in out.stderr
        assert len(lines) == 1 and fragment in lines[0], (args, lines)
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


EVAL_BAD = [("causal", "PATH: '{causal}' is not a sequence classifier (architectures: LlamaForCausalLM)"),
            ("two", "PATH: '{two}' has 2 labels; a reward model has one"),
            ("notok", "PATH: '{notok}' has no tokenizer the reward model can use"),
            ("pickled", "PATH: '{pickled}' has pickled weights only (pytorch_model.bin)"),
            ("nohead", "PATH: '{nohead}' has no trained score head (score.weight missing")]


def test_reward_model_eval_refuses_what_train_refuses_in_one_line(tmp_path, rlctl_app):
    """`rlctl reward-model eval` loads through RewardModel: the same checks as a run (the
    first case through the console script, the others in-process)."""
    dirs = _bad_dirs(tmp_path)
    prefs = tmp_path / "p.jsonl"
    prefs.write_text(json.dumps({"prompt": "2 1 =", "chosen": "1 2", "rejected": "2 1"}) + "\n")
    for i, (name, fragment) in enumerate(EVAL_BAD):
        out = (_rlctl if i == 0 else _in_process(rlctl_app))(tmp_path, "reward-model", "eval",
                                                             dirs[name], prefs)
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert out.returncode == 2 and "Traceback" not in out.stderr, (name, out.stderr[-1500:])
        assert len(lines) == 1 and fragment.format(**dirs) in lines[0], (name, lines)
    ok = rlctl_app("reward-model", "eval", dirs["other"], prefs, cwd=tmp_path)
    assert ok.returncode == 0 and "pairwise accuracy" in ok.stdout, ok.stderr[-1500:]


# ---- reward entries: task.reward_model and {model: ...} in task.rewards -------------------
def _task(tmp_path, *overrides):
    from rlctl.config.compose import compose
    from rlctl.train.build import task_from_config

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} =", "answer": str(i)}) + "\n"
                            for i in range(6)))
    return task_from_config(compose(["task=jsonl", f"task.train_path={data}",
                                     "task.num_eval=2", *overrides]).cfg)


def test_a_data_task_scored_by_reward_models_alone_or_beside_functions(tmp_path):
    rm_dir = save_rm(tmp_path / "rm")
    alone = _task(tmp_path, f"task.reward_model={rm_dir}")
    assert alone.task.rewards == [] and alone.learned.replace_task
    (m,) = alone.learned.models
    assert (m.name, m.weight, m.key) == ("reward_model", 1.0, "task.reward_model")
    mixed = _task(tmp_path, f"task.rewards=[{{fn: exact}},{{model: '{rm_dir}', name: rm, "
                            "weight: 0.5}]")
    assert [r.name for r in mixed.task.rewards] == ["exact"]
    (m,) = mixed.learned.models
    assert (m.name, m.weight, m.key) == ("rm", 0.5, "task.rewards[1].model")
    assert not mixed.learned.replace_task
    only = _task(tmp_path, f"task.rewards=[{{model: '{rm_dir}'}}]")
    assert only.task.rewards == [] and only.learned.models[0].name == "reward_model"


@pytest.mark.parametrize("overrides, fragment", [
    ([], "a data task needs a reward"),
    (["task.reward_model={rm}", "task.rewards=[{{model: '{rm}'}}]"],
     "set task.reward_model or {model: ...} entries in task.rewards, not both"),
    (["task.rewards=[{{fn: exact}},{{model: '{rm}', bogus: 1}}]"],
     "task.rewards[1]: unknown key 'bogus' for a reward model; valid: model, weight, name"),
    (["task.rewards=[{{model: '{rm}', weight: abc}}]"],
     "task.rewards[0]: weight must be a finite number, got 'abc'"),
    (["task.rewards=[{{model: '{rm}', name: exact}},{{fn: exact}}]"],
     "task.rewards[0].model: the reward name 'exact' is already used"),
])
def test_bad_reward_entries_are_one_line(tmp_path, overrides, fragment):
    from rlctl.errors import UserError

    rm_dir = save_rm(tmp_path / "rm")
    with pytest.raises(UserError) as err:
        _task(tmp_path, *[o.format(rm=rm_dir) for o in overrides])
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_critic_from_the_reward_model_starts_at_the_score_without_the_final_token(tmp_path):
    """What the value head starts at (models/value.py): the learner runs the critic on the
    sequence less its last token and reads completion token t one position before it, so
    the last completion value is the reward model's score of the sequence without its
    final token, checked against a plain transformers forward of that shorter sequence."""
    tok = tiny.build_tokenizer()
    rm = RewardModel(save_rm(tmp_path / "rm", tok))                   # float64
    critic = SeparateCritic.from_sequence_classifier(rm.load())
    ids = tok(["3 1 4 = 1 3 4"], return_tensors="pt")["input_ids"]    # [1, L]
    plen = len(tok("3 1 4 =")["input_ids"])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = critic(ids[:, :-1], mask[:, :-1], (mask[:, :-1].cumsum(-1) - 1))  # [1, L-1]
        last = float(values[0, -1])           # V(s_{T-1}): the prompt and all but the last token
        without_final = float(rm.load()(input_ids=ids[:, :-1]).logits[0, 0])
        whole = float(rm.load()(input_ids=ids).logits[0, 0])
    # float64 forwards of the same ids; the value head is float32: relative 1e-6 bounds it
    assert last == pytest.approx(without_final, rel=1e-6, abs=1e-6)
    assert abs(whole - without_final) > 1e-3                           # the two really differ


def test_the_load_time_check_reads_transformers_loading_report(tmp_path):
    """Where the weights' names cannot be read up front (here: the header check is given
    no keys), loading still refuses a head transformers reports as newly initialised."""
    dirs = _bad_dirs(tmp_path)
    from rlctl.rm import learned as rm_mod

    rm = RewardModel(dirs["other"])
    rm.load()                                            # a trained head: loads
    rm.path = dirs["nohead"]
    rm.model = None
    with pytest.raises(ValueError, match="has no trained score head .score.weight missing"):
        rm.load()
    assert rm_mod.untrained_head_problem(["score.weight"], {"model.score.weight"}) is None
