"""`rlctl inspect FILE.jsonl`: the audit of a rollout file (EOS/mask alignment, truncation, reward-hacking signs)."""
