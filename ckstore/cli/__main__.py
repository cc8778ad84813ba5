from ckstore.cli import run

run()
