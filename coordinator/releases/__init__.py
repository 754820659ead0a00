"""The representation a run releases, and the releases that outlive the run: the release phase
after training (`phase`: the export, its manifest, the pools gathered from devices), the run's
body rebuilt for export (`representation`), numbered versions (`store`), which one each weak
device runs (`inventory`), and the service that keeps answering weak devices and rolls new
releases out in stages (`service`, `edgepfl release serve`)."""
