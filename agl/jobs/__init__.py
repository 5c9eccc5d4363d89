"""The jobs ``algo=`` names, one module each, and ``dispatch`` (run dir, status, resume) that runs them."""
