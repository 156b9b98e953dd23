"""Launch recipes: load the YAML files in ``configs/``, validate them, render a step's argv.

A *recipe* is what one upstream ``training_scripts/**/run_*.sh`` was: launcher options plus the
flags of one step's ``main.py``, with a few positional parameters (upstream's ``$1``..``$5``).
``configs/`` is the one source of truth; ``dschat.launch``, the generated shell scripts and
``e2e_rlhf.py`` all read it through this package. The format is described in ``configs/README.md``.

One module per idea: the steps (:mod:`.steps`), a recipe and the argv it renders (:mod:`.recipe`),
finding the checkout and loading its recipes (:mod:`.loading`), the generated shell scripts and
READMEs (:mod:`.scripts`), ``docs/flags.md`` (:mod:`.flags_doc`, with upstream's flag names in
:mod:`.upstream_flags`) and a small CLI (:mod:`.cli`, ``python -m dschat.recipes``: ``list``,
``show``, ``validate``, ``write-scripts`` / ``check-scripts``, ``write-flags-doc`` / ``check-flags-doc``).
"""
