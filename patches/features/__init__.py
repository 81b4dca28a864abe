"""Options and improvements the stock code does not have (same results): a dtype choice, a
tokenizer load that trusts remote code, faster and lighter transport of the captured states, the
driver's threads, the report lines. Left off where no validation run recorded them."""
