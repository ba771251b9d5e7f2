"""Compute modelling and placement: predict a job's time, WAN bytes and cost on a candidate
placement, and choose the placement and strategy that minimise the user's weighted objective."""
