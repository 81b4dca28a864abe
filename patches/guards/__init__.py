"""The library's own guards: clear errors for bad input and broken results, a dead worker named,
atomic writes into a crash-safe output folder. Left off where no validation run recorded them."""
