"""`atelier run`: the whole recipe (model, tasks, eval, SFT, RL, eval, report) as resumable stages."""
