"""Releases that outlive the training run: numbered versions (`store`), which one each weak
device runs (`inventory`), and the service that keeps answering weak devices and rolls new
releases out in stages (`service`, `edgepfl release serve`)."""
