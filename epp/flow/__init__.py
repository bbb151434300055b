"""Flow control: the admission that holds requests the pool cannot take yet (the
saturation queue and the waiting room), and the demand it reports to the scaler."""
