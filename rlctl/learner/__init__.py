"""The learner: the training loop, the policy update, advantages, the learner forward pass, metric statistics and held-out evaluation."""
