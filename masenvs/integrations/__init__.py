"""masenvs environments inside other trainers: TRL, verifiers, OpenEnv.

Each mapping is thin and sits on `TextEpisode` (episode.py), one masenvs episode as a
turn-taking text game: the env's own prompts in, the env's own rewards out, nothing added.
"""
