"""Episodes on real architectures with chat templates: a Llama-3-like and a Qwen2.5-like
model (tests/models/real_arch.py), and two hybrids from tests/models/arch_zoo.py (real_arch
has none): LFM2 (short convolutions beside attention; cache per row) and RecurrentGemma
(its RG-LRU state lives in its modules: contexts run one length at a time). Random init,
float64, tokenizers trained locally.

The Llama and Qwen templates here have a TOOL role, written as their released templates
write one (Llama 3.1: an ``ipython`` header; Qwen2.5: a user turn holding
``<tool_response>``); LFM2's ChatML and Gemma's have none, so observations are user turns.

Checked: (1) after a turn, an observation's tokens are the template's text beyond the
sampled tokens, hand-written per template below (prefix path; the fallback of a template
that rewrites earlier text: tests/rollout/test_episode_chat.py); (2) played episodes: the
learner's log-probs of the stored ids equal the behaviour log-probs turn by turn, and every
observation span holds the observation in its role's markers.

Tolerance of (2): the models run in float64 but transformers' RMSNorms compute in float32
and cast back (unit roundoff 6e-8), carried through a few hundred accumulated O(1) terms:
1e-5 bounds the log-prob difference (as tests/models/test_hybrid_caches.py derives);
sampling with another context (left padding, cache vs no cache) than the learner's batch
changes only those roundings (measured: at most 9e-16, RecurrentGemma; 0 on the others,
whose roundings fell alike). A wrong position or a re-tokenized turn moves log-probs by
O(1) on a random model."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from episode_runs import model_turn_gaps, player_settings  # noqa: E402
from arch_zoo import TOKENIZERS, build_config  # noqa: E402
from real_arch import SPECS, build_model, build_tokenizer  # noqa: E402

from rlctl.envs.environment import EnvTask# noqa: E402
from rlctl.models.forward import learner_forward# noqa: E402
from rlctl.rollout.episodes.text import EpisodeText# noqa: E402
from rlctl.rollout.episodes.loop import EpisodePlayer  # noqa: E402
from rlctl.tasks.task import TaskOptions# noqa: E402
from rlctl.types import MODEL, OBSERVATION, Example, Step  # noqa: E402

QWEN_TOOL = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TOOL = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>"
    "{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# name -> (the sampled turn's end-of-turn token, the observation "ok 3" after it, by hand)
AFTER_A_TURN = {
    "llama": ("<|eot_id|>", "<|start_header_id|>ipython<|end_header_id|>\n\nok 3<|eot_id|>"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": ("<|im_end|>", "\n<|im_start|>user\n<tool_response>\nok 3\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n"),
    "lfm2": ("<|im_end|>", "\n<|im_start|>user\nok 3<|im_end|>\n<|im_start|>assistant\n"),
    "recurrent_gemma": ("<end_of_turn>", "\n<start_of_turn>user\nok 3<end_of_turn>\n<start_of_turn>model\n"),
}
# where an observation's content sits: the marker its role's turn opens with
OPENS = {"llama": "ipython<|end_header_id|>", "qwen2": "<tool_response>",
         "lfm2": "<|im_start|>user", "recurrent_gemma": "<start_of_turn>user"}


def _tokenizer(name):
    if name in ("llama", "qwen2"):
        tok = build_tokenizer(name)
        tok.chat_template = LLAMA_TOOL if name == "llama" else QWEN_TOOL
        return tok, SPECS[name]["stops"]
    family = "lfm2" if name == "lfm2" else "gemma"
    return build_tokenizer(family, TOKENIZERS[family]), TOKENIZERS[family]["stops"]


@pytest.fixture(scope="module")
def arch():
    """``arch(name)`` -> (float64 model, tokenizer, stop ids), built once."""
    from transformers import AutoModelForCausalLM

    built = {}

    def get(name):
        if name not in built:
            tok, stops = _tokenizer(name)
            if name in ("llama", "qwen2"):
                model = build_model(name, tok)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    model = AutoModelForCausalLM.from_config(build_config(name, tok))
            built[name] = (model.double().eval(), tok, [tok.convert_tokens_to_ids(t) for t in stops])
        return built[name]
    return get


def _text(tok):
    return EpisodeText(tok, chat=True, system_prompt=None, max_obs_tokens=64, obs_truncation="right")


@pytest.mark.parametrize("name", list(AFTER_A_TURN))
def test_an_observation_after_a_turn_is_the_templates_text_beyond_it(name):
    tok, _ = _tokenizer(name)
    text = _text(tok)
    assert text.role == ("tool" if name in ("llama", "qwen2") else "user")
    _, ids, messages = text.first("sort 3 1 2")
    end, want = AFTER_A_TURN[name]
    turn = tok("1 2 3" + end, add_special_tokens=False)["input_ids"]          # as sampled
    obs, cut, _ = text.observation("ok 3", ids + turn, messages, "1 2 3")
    assert tok.decode(obs) == want and not cut
    if name == "qwen2":         # a turn cut before its end token: the observation closes it
        _, ids, messages = text.first("sort 3 1 2")
        cut_turn = tok("1 2", add_special_tokens=False)["input_ids"]
        obs, _, _ = text.observation("ok 3", ids + cut_turn, messages, "1 2")
        assert tok.decode(obs) == "<|im_end|>" + want


class Answers:
    """Answers every turn with "ok 3"; done after the third."""

    def reset(self, example, seed):
        self.k = 0
        return example.prompt

    def step(self, turn):
        self.k += 1
        return Step(observation="ok 3", reward=float(self.k), done=self.k >= 3)


@pytest.mark.parametrize("name", list(AFTER_A_TURN))
def test_learner_logprobs_equal_behaviour_turn_by_turn_on_real_architectures(arch, name):
    model, tok, stops = arch(name)
    rows = [Example("sort 3 1 2"), Example("answer 7")]
    task = EnvTask("answers", Answers, rows, rows)
    task.rlctl_options = TaskOptions(prompt_format="chat")
    settings = player_settings(group_size=2, max_new_tokens=4, temperature=1.0, max_turns=3,
                               max_tokens=80)
    torch.manual_seed(0)
    batch = EpisodePlayer(tok, task, *settings, stops).play(model, rows, seed=0)
    assert batch.logprobs.old.dtype == torch.float64
    learner = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
    for i, s, gap in model_turn_gaps(batch, learner):
        assert gap < 1e-5, (name, i, s, gap)
    for i, e in enumerate(batch.episodes.records):
        for s in e.spans:
            if s.role != MODEL:
                assert s.role == OBSERVATION and (batch.mask[i, s.start:s.end] == 0).all()
                shown = tok.decode(batch.completion_ids[i, s.start:s.end], skip_special_tokens=False)
                assert OPENS[name] in shown and "ok 3" in shown, (name, shown)
