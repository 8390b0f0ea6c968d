"""rlctl's preference losses beside TRL's trainers on one batch (issue 35; not a test).

    python bench/trl_dpo.py --trl-python /work/trlvenv/bin/python [--dtype float64]

Builds, in a temporary directory, a byte-level BPE tokenizer trained here and two
random-init Llamas (the reference, and the policy: the reference with its weights nudged),
and a handful of prompt / chosen / rejected pairs. A subprocess in TRL's environment runs
DPOTrainer (loss_type sigmoid and ipo) and, where TRL has it, CPOTrainer (loss_type simpo,
cpo_alpha 0, with label smoothing) on all pairs as one batch and prints each loss and the
token ids it used. This process scores the same token ids with rlctl's learner forward
(`rlctl.models.forward.learner_forward`: left-padded prompts, the fused log-softmax) and
the `rlctl.core.preference.PREFERENCE_LOSSES` entries, and prints both and the difference.
TRL's DPOTrainer has no cDPO smoothing of its sigmoid loss any more; the smoothing form is
compared through SimPO's, which TRL's CPOTrainer applies the same way. TRL is not an rlctl
dependency: it only needs to be importable by --trl-python."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BETA, SIMPO_BETA, SIMPO_GAMMA, SMOOTHING = 0.1, 2.0, 0.5, 0.1
PAIRS = [  # prompt, chosen, rejected (completions of different lengths)
    ("sort: 3 1 2 ->", " 1 2 3", " 3 2 1"),
    ("sort: 9 4 ->", " 4 9", " 9 4 4 4"),
    ("sort: 5 5 0 7 ->", " 0 5 5 7", " 0 5 7"),
    ("sort: 8 2 6 1 3 ->", " 1 2 3 6 8", " 1 2"),
    ("add: 2 + 5 =", " 7", " 25"),
    ("add: 11 + 4 =", " 15", " 16 and more"),
]


def build(out: Path) -> None:
    """out/ref and out/policy: a tokenizer trained here and two small Llamas (seed 0)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<pad>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [p + c + r for p, c, r in PAIRS] * 5 + ["sort add and more 0123456789 -> = +"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=specials[0], eos_token=specials[1],
                                  pad_token=specials[2], clean_up_tokenization_spaces=False)
    conf = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(conf)
    for name in ("ref", "policy"):
        if name == "policy":           # a policy away from the reference: the loss is not log 2
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)


def trl_side(work: Path, dtype_name: str) -> None:
    """Runs in TRL's environment: one JSON line per loss with TRL's loss and token ids."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    tok = AutoTokenizer.from_pretrained(work / "ref")
    ds = datasets.Dataset.from_list([dict(prompt=p, chosen=c, rejected=r) for p, c, r in PAIRS])
    load = lambda name: AutoModelForCausalLM.from_pretrained(work / name, dtype=dtype)
    common = dict(report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=len(PAIRS))
    runs = [("sigmoid", "dpo", dict(loss_type=["sigmoid"], beta=BETA, max_length=None)),
            ("ipo", "dpo", dict(loss_type=["ipo"], beta=BETA, max_length=None))]
    try:
        import trl.experimental.cpo as cpo
    except ImportError:        # older TRL: trl.CPOTrainer / trl.CPOConfig
        cpo = trl if hasattr(trl, "CPOTrainer") else None
    if cpo is not None:
        runs.append(("simpo", "cpo", dict(loss_type="simpo", beta=SIMPO_BETA, simpo_gamma=SIMPO_GAMMA,
                                          cpo_alpha=0.0, label_smoothing=SMOOTHING)))
    for name, kind, kw in runs:
        out = str(work / f"trl-{name}")
        if kind == "dpo":
            trainer = trl.DPOTrainer(model=load("policy"), ref_model=load("ref"), processing_class=tok,
                                     args=trl.DPOConfig(output_dir=out, **common, **kw), train_dataset=ds)
            rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
            ids = [(r["prompt_ids"], r["chosen_ids"], r["prompt_ids"], r["rejected_ids"]) for r in rows]
            with torch.no_grad():
                loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
        else:
            trainer = cpo.CPOTrainer(model=load("policy"), processing_class=tok, train_dataset=ds,
                                     args=cpo.CPOConfig(output_dir=out, **common, **kw))
            rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
            cut = lambda r, k: (r[f"{k}_input_ids"][:r[f"{k}_labels"].count(-100)],
                                r[f"{k}_input_ids"][r[f"{k}_labels"].count(-100):])
            ids = [cut(r, "chosen") + cut(r, "rejected") for r in rows]    # prompt, completion x 2
            with torch.no_grad():
                loss, _ = trainer.get_batch_loss_metrics(trainer.model, trainer.data_collator(rows))
        print(json.dumps(dict(loss_type=name, trl=trl.__version__, loss=float(loss), ids=ids)))


def rlctl_side(work: Path, dtype_name: str, name: str, ids) -> float:
    """rlctl's loss on TRL's token ids (per pair: chosen prompt, chosen, rejected prompt,
    rejected): learner_forward log-probs summed per completion, the registry's loss, mean."""
    import torch

    from rlctl.core import PREFERENCE_LOSSES
    from rlctl.models.forward import learner_forward
    from rlctl.models.loading import load_model_and_tokenizer

    entry = PREFERENCE_LOSSES.entry(name)
    prompts = [row[0] for row in ids] + [row[2] for row in ids]      # rows: chosen then rejected
    completions = [row[1] for row in ids] + [row[3] for row in ids]
    P, T = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.full((len(prompts), P + T), 2)           # [2n, P+T], pad id 2
    attention = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention[i, P - len(p):P + len(c)] = 1
    mask = attention[:, P:].to(getattr(torch, dtype_name))     # [2n, T] completion tokens

    def summed(model_dir: str) -> torch.Tensor:
        model, _ = load_model_and_tokenizer("hf", str(work / model_dir))   # float32 on disk
        model.to(mask.dtype)
        with torch.no_grad():
            logp = learner_forward(model.eval(), input_ids, attention, P).logp   # [2n, T]
        return (logp * mask).sum(-1)                                            # [2n]

    n = len(ids)
    pol = summed("policy")
    ref = summed("ref") if entry.needs_reference else None
    lens = mask.sum(-1)
    kw = dict(beta=BETA) if name != "simpo" else dict(beta=SIMPO_BETA, gamma=SIMPO_GAMMA,
                                                      label_smoothing=SMOOTHING)
    loss = entry.fn(pol[:n], pol[n:], None if ref is None else ref[:n],
                    None if ref is None else ref[n:], lens[:n], lens[n:], **kw)[0]
    return float(loss.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default=sys.executable, help="a python that can import trl")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--trl-side", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    if args.trl_side:
        return trl_side(args.trl_side, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build(work)
        proc = subprocess.run([args.trl_python, __file__, "--trl-side", str(work), "--dtype", args.dtype],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the TRL side failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        print(f"TRL {results[0]['trl']}, {len(PAIRS)} pairs, {args.dtype}, beta {BETA} "
              f"(simpo: beta {SIMPO_BETA}, gamma {SIMPO_GAMMA}, label_smoothing {SMOOTHING})")
        print(f"{'loss':8} {'rlctl':>22} {'TRL':>22} {'|difference|':>13}")
        for r in results:
            ours = rlctl_side(work, args.dtype, r["loss_type"], r["ids"])
            print(f"{r['loss_type']:8} {ours:22.16f} {r['loss']:22.16f} {abs(ours - r['loss']):13.3e}")


if __name__ == "__main__":
    main()
