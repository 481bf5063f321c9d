"""Studies beside the package: recipes compared by what vLLM accepts (``python -m studies <name>``).

They train with ``train.py``, serve with vLLM and drive the peers' own trainers (``studies/peers/``), so they
run from a checkout; the package (specforge_lite) holds what a user runs."""
