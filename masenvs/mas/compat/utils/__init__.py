"""The published system's `utils` as designs import it: only `utils.environments`."""
