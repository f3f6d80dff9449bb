"""Op families: each module defines its kernel ops and differentiable Functions side by side."""
