"""The embedded inference engine."""
