from .base import run

run()
