"""speculators 0.4.x: bugs of its own generator loop that give wrong or missing results."""
