"""Multi-turn environments: the interface, tools and their sandbox, the built-in ones
(``rlctl.envs.builtin``, imported when ``rlctl.tasks.build_task`` first builds one)."""
