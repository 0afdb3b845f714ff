"""The hfport HTTP service (FastAPI). Built in the service issue; the package exists so installs stay stable."""
