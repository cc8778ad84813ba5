"""Training state: nested state dicts committed and loaded without pickle, partial loads, and legacy
torch.save files imported safely."""
