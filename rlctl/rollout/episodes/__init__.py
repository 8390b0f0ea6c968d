"""Episodes: the multi-turn loop of model turns and environment observations, its batch and its rollout source."""
