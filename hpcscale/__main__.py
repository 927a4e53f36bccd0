"""`python -m hpcscale` is the `hpcscale` command (what hpcscale starts itself runs through util/pystart)."""

from hpcscale.cli.entry import main

main()
