"""The run's configuration: settings sections, RunConfig from defaults, TOML and flags, the flags."""
