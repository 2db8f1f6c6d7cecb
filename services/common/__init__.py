"""Runtime shared by every pcpstack service: servers, channels, telemetry, logging and configuration."""
