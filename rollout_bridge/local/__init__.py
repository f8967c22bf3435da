"""The in-process engine (`LocalEngine`): rollouts from a torch model, no server."""
