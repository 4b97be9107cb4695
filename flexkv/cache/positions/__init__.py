"""Where a query and a key sit: retention as FlexAttention masks over stream indices (`masks`), rotary
positions in both position systems (`rotary`), and relative-position attention (`relative_position`)."""
