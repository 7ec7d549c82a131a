"""Every service's settings, one module per service: what each process reads from its config file,
its environment (SPOPP_<SERVICE>_<FIELD>) and its command line, checked before it starts. Nothing
here imports torch, vLLM or DeepSpeed (an import contract holds it), so `--help` is instant and the
launcher can validate a whole run before anything starts.

A service's settings are built from groups, each declared once: the groups of fields several
services share stand below this package, where the code that reads them lives.

    Settings, SettingsGroup   spopp/settings/base.py             the base: sources, their order, flags
    RunBinding                spopp/settings/run_binding.py      the run, its tracker, the token
    ClaimSettings             spopp/settings/claim_settings.py   a GPU or slot claimed at start-up
    EpisodeTuning             runtime/episode_settings.py        how an episode is played, and its bounds
    EnvChoice                 runtime/envs/choice.py             the environment and its options
    HttpServerSettings        services/shell/http_settings.py    the bounded HTTP server's limits

The tree (the *Tuning classes are what an operator tunes, and what `spopp launch`'s sections take;
the *Settings classes add what binds a process to its run):

    tracker.py      TrackerTuning(HttpServerSettings)
                    TrackerSettings(TrackerTuning, Settings)
    rollout.py      RolloutTuning(EpisodeTuning, ClaimSettings, HttpServerSettings)
                    RolloutSettings(RolloutTuning, RunBinding, EnvChoice, Settings)
    learner.py      LearnerTuning(HttpServerSettings)
                    LearnerSettings(LearnerTuning, RunBinding, Settings)
    evaluator.py    EvaluatorEpisodes(EpisodeTuning)
                    EpisodeSettings(EvaluatorEpisodes, EnvChoice, Settings)
                    EvaluatorTuning(EvaluatorEpisodes, ClaimSettings, HttpServerSettings)
                    ScoreSettings(EvaluatorTuning, EnvChoice, Settings)
                    EvaluatorSettings(RunBinding, ScoreSettings)
    prior.py        PriorSettings(EpisodeSettings)
    init.py         InitSettings(RunBinding, Settings)
    supervision.py  SupervisionSettings(BaseModel)
    launch.py       GpuPlan(BaseModel)
                    Section(BaseModel)
                    TrackerSection(Section, TrackerTuning)
                    RolloutSection(Section, RolloutTuning)
                    LearnerSection(Section, LearnerTuning)
                    EvaluatorSection(Section, EvaluatorTuning)
                    LaunchSettings(Settings)

tests/config/test_settings_tree.py holds this drawing to the code.
"""
